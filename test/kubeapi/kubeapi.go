// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package kubeapi starts a real etcd and kube-apiserver on 127.0.0.1 for
// end-to-end tests, once per test binary:
//
//	func TestMain(m *testing.M) {
//		cluster, err := kubeapi.Start(context.Background())
//		... run m, then cluster.Stop()
//	}
//
// The binaries are built by `make kube-bins` into .cache/kube/<version>/ (see
// the Makefile); Start finds them through $AMBIENT_EBPF_KUBE_BINS or by
// walking up from the working directory to that folder. There is no kubelet,
// scheduler or controller-manager: pods are created with spec.nodeName set and
// their status is written by the test (UpdateStatus), and namespaces must have
// unique names because a deleted namespace stays Terminating forever.
package kubeapi

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
)

// Version is the kube-apiserver version the Makefile builds.
const Version = "v1.37.2"

// BinsEnv names the environment variable that points at the folder holding
// kube-apiserver and etcd.
const BinsEnv = "AMBIENT_EBPF_KUBE_BINS"

// ErrNoBinaries is returned by Start when kube-apiserver or etcd is not
// built; tests skip on it (or fail under CI=true).
var ErrNoBinaries = errors.New("kube-apiserver and etcd not built (run make kube-bins)")

// ErrShort is what a TestMain reports instead of starting the API server
// under -short (make test-unit): tests that need it skip on it.
var ErrShort = errors.New("no kube-apiserver under -short (make test-unit)")

const token = "ambient-ebpf-test-token"

// Cluster is a running etcd + kube-apiserver pair.
type Cluster struct {
	// Config reaches the API server as a member of system:masters.
	Config *rest.Config
	// Client is a clientset over Config.
	Client kubernetes.Interface

	dir     string
	procs   []*process // started order: etcd, then kube-apiserver
	stopped *process   // kube-apiserver after KillAPIServer
}

const apiServer = "kube-apiserver"

type process struct {
	name string
	bin  string
	args []string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// FindBinaries returns the folder holding kube-apiserver and etcd, or
// ErrNoBinaries.
func FindBinaries() (string, error) {
	var candidates []string
	if d := os.Getenv(BinsEnv); d != "" {
		candidates = append(candidates, d)
	}
	if wd, err := os.Getwd(); err == nil {
		for d := wd; ; d = filepath.Dir(d) {
			candidates = append(candidates, filepath.Join(d, ".cache", "kube", Version))
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	for _, d := range candidates {
		if isExecutable(filepath.Join(d, "kube-apiserver")) && isExecutable(filepath.Join(d, "etcd")) {
			return d, nil
		}
	}
	return "", ErrNoBinaries
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// Start runs etcd and kube-apiserver on free loopback ports in a fresh
// temporary folder and returns once /readyz answers 200. The processes are
// tied to ctx only through Stop: call Stop when the test binary ends.
func Start(ctx context.Context) (*Cluster, error) {
	bins, err := FindBinaries()
	if err != nil {
		return nil, err
	}
	// A free port can be taken by another process between the probe and
	// the server's bind; such a start fails fast and is tried again.
	var errs []error
	for range 3 {
		dir, err := os.MkdirTemp("", "kubeapi-")
		if err != nil {
			return nil, fmt.Errorf("temp dir: %w", err)
		}
		c := &Cluster{dir: dir}
		err = c.start(ctx, bins)
		if err == nil {
			return c, nil
		}
		errs = append(errs, err)
		c.Stop()
		if ctx.Err() != nil {
			break
		}
	}
	return nil, errors.Join(errs...)
}

func (c *Cluster) start(ctx context.Context, bins string) error {
	if err := writeCredentials(c.dir); err != nil {
		return err
	}
	ports, err := freePorts(3)
	if err != nil {
		return err
	}
	clientURL := "http://127.0.0.1:" + strconv.Itoa(ports[0])
	peerURL := "http://127.0.0.1:" + strconv.Itoa(ports[1])
	if err := c.spawn("etcd", filepath.Join(bins, "etcd"),
		"--name=test",
		"--data-dir="+filepath.Join(c.dir, "etcd"),
		"--listen-client-urls="+clientURL, "--advertise-client-urls="+clientURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=test="+peerURL,
		"--unsafe-no-fsync", "--log-level=warn",
	); err != nil {
		return err
	}
	apiPort := strconv.Itoa(ports[2])
	if err := c.spawn(apiServer, filepath.Join(bins, apiServer),
		"--etcd-servers="+clientURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
		"--secure-port="+apiPort,
		"--cert-dir="+filepath.Join(c.dir, "certs"),
		"--token-auth-file="+filepath.Join(c.dir, "tokens.csv"),
		// RBAC, so tests can check the chart's roles; the tests' own
		// token is system:masters, which RBAC always allows.
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file="+filepath.Join(c.dir, "sa.pub"),
		"--service-account-signing-key-file="+filepath.Join(c.dir, "sa.key"),
		"--service-cluster-ip-range=10.96.0.0/16",
		// 127.0.0.1 is refused as an endpoint address by the reconciler.
		"--endpoint-reconciler-type=none",
		// As clusters run it (kubeadm, the providers), so privileged
		// containers pass validation.
		"--allow-privileged=true",
		// No controller-manager creates the default ServiceAccount.
		"--disable-admission-plugins=ServiceAccount",
	); err != nil {
		return err
	}
	c.Config = &rest.Config{
		Host:            "https://127.0.0.1:" + apiPort,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{Insecure: true},
		QPS:             200,
		Burst:           400,
	}
	if err := c.waitReady(ctx, 90*time.Second); err != nil {
		return err
	}
	c.Client, err = kubernetes.NewForConfig(c.Config)
	if err != nil {
		return fmt.Errorf("clientset: %w", err)
	}
	return nil
}

// writeCredentials writes the service-account key pair and the static token
// file the API server needs.
func writeCredentials(dir string) error {
	key := filepath.Join(dir, "sa.key")
	for _, args := range [][]string{
		{"genrsa", "-out", key, "2048"},
		{"rsa", "-in", key, "-pubout", "-out", filepath.Join(dir, "sa.pub")},
	} {
		if out, err := exec.Command("openssl", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("openssl %s: %w: %s", args[0], err, out)
		}
	}
	line := token + ",admin,admin-uid,system:masters\n"
	if err := os.WriteFile(filepath.Join(dir, "tokens.csv"), []byte(line), 0o600); err != nil {
		return fmt.Errorf("token file: %w", err)
	}
	return nil
}

// freePorts asks the kernel for n distinct free loopback ports. They are
// released before use, so another process could take one in between; the
// API server then fails to start and Start reports it.
func freePorts(n int) ([]int, error) {
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("free port: %w", err)
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

func (c *Cluster) spawn(name, bin string, args ...string) error {
	// Appended to: a restarted server's log follows its predecessor's.
	logf, err := os.OpenFile(filepath.Join(c.dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("%s log: %w", name, err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own process group, so a terminal's ^C reaches only the test binary,
	// which then stops it in order. No Pdeathsig: it fires when the forking
	// OS thread exits, and the suites lock threads into netns that do exit.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, bin: bin, args: args, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	c.procs = append(c.procs, p)
	return nil
}

func (c *Cluster) waitReady(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, //nolint:gosec // test API server's self-signed cert
	}}
	defer hc.CloseIdleConnections()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		for _, p := range c.procs {
			select {
			case <-p.done:
				return fmt.Errorf("%s exited before the api server was ready: %v; log ends:\n%s", p.name, p.err, c.logTail(p.name))
			default:
			}
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.Config.Host+"/readyz", nil)
		if err != nil {
			return fmt.Errorf("readyz request: %w", err)
		}
		req.Header.Set("Authorization", "Bearer "+token)
		if resp, err := hc.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("api server not ready: %w; log ends:\n%s", ctx.Err(), c.logTail("kube-apiserver"))
		case <-tick.C:
		}
	}
}

// logTail returns the last few lines of a process's log, for errors: the
// folder is removed when a start fails.
func (c *Cluster) logTail(name string) string {
	b, err := os.ReadFile(c.LogPath(name))
	if err != nil {
		return err.Error()
	}
	const keep = 2048
	if len(b) > keep {
		b = b[len(b)-keep:]
	}
	return string(b)
}

// KillAPIServer ends kube-apiserver with SIGKILL, as a crash or a
// control-plane node's reboot does; etcd runs on, and StartAPIServer
// brings it back on the same address. Clients see connections refused
// meanwhile.
func (c *Cluster) KillAPIServer() error {
	i := slices.IndexFunc(c.procs, func(p *process) bool { return p.name == apiServer })
	if i < 0 {
		return errors.New("kube-apiserver is not running")
	}
	p := c.procs[i]
	if err := p.cmd.Process.Kill(); err != nil {
		return fmt.Errorf("kill kube-apiserver (pid %d): %w", p.cmd.Process.Pid, err)
	}
	<-p.done
	c.procs = slices.Delete(c.procs, i, i+1)
	c.stopped = p
	return nil
}

// StartAPIServer starts kube-apiserver again after KillAPIServer, with the
// same command line, and waits until it is ready.
func (c *Cluster) StartAPIServer(ctx context.Context) error {
	p := c.stopped
	if p == nil {
		return errors.New("kube-apiserver was not killed")
	}
	if err := c.spawn(p.name, p.bin, p.args...); err != nil {
		return err
	}
	c.stopped = nil
	return c.waitReady(ctx, 90*time.Second)
}

// ServingCert returns the API server's self-signed serving certificate
// (with its CA), which clients inside a node use as ca.crt.
func (c *Cluster) ServingCert() ([]byte, error) {
	return os.ReadFile(filepath.Join(c.dir, "certs", "apiserver.crt"))
}

// LogPath returns the log file of "etcd" or "kube-apiserver".
func (c *Cluster) LogPath(name string) string { return filepath.Join(c.dir, name+".log") }

// Stop sends SIGTERM to kube-apiserver, then etcd, waits for each to exit
// (SIGKILL after 15 s), and removes the temporary folder. It is safe to call
// more than once.
func (c *Cluster) Stop() {
	for i := len(c.procs) - 1; i >= 0; i-- {
		p := c.procs[i]
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(15 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	}
	c.procs = nil
	if c.dir != "" && os.Getenv("KUBEAPI_KEEP") == "" {
		os.RemoveAll(c.dir)
	}
}

// ServiceAccount returns a client config that acts as the service account
// namespace/name (impersonated by the test's admin identity), so that only
// the RBAC rules bound to it apply.
func (c *Cluster) ServiceAccount(namespace, name string) *rest.Config {
	cfg := rest.CopyConfig(c.Config)
	cfg.Impersonate = rest.ImpersonationConfig{
		UserName: "system:serviceaccount:" + namespace + ":" + name,
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace, "system:authenticated"},
	}
	return cfg
}

// Require returns the cluster Start returned, or skips the test (fails it
// under CI=true) when Start found no binaries, and fails it when they did
// not start.
func Require(tb testing.TB, c *Cluster, startErr error) *Cluster {
	tb.Helper()
	if errors.Is(startErr, ErrShort) {
		tb.Skip(startErr)
	}
	if errors.Is(startErr, ErrNoBinaries) {
		testenv.SkipOrFail(tb, "%v", startErr)
	}
	if startErr != nil {
		tb.Fatalf("start kube-apiserver: %v", startErr)
	}
	return c
}
