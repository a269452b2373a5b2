// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package install puts the ambient-ebpf CNI plugin on the node and keeps it
// there: it copies the plugin binary into the host CNI bin directories,
// chains the plugin into the highest-priority CNI configuration in place or
// into an owned copy of it that runtimes select first (or writes a conflist
// holding only the plugin), writes the plugin's narrow kubeconfig, repairs drift
// it sees through fsnotify, and on uninstall removes exactly what it added.
package install

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fsnotify/fsnotify"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/fallback"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/plugin"
)

// PluginType is the type of our conflist entry and the binary's file name.
const PluginType = plugin.PluginType

// Config says where things go on the host.
type Config struct {
	// PluginBinary is the plugin binary shipped with the agent; its
	// fallback binary (ambient-ebpf-cni-fallback) is beside it.
	PluginBinary string
	// BinDirs are the host CNI bin directories (e.g. /opt/cni/bin); each must exist.
	BinDirs []string
	// ConfDir is the host CNI configuration directory (e.g. /etc/cni/net.d); it must exist.
	ConfDir string
	// OwnConflist, when set, is the file name of a conflist holding only our
	// plugin, written instead of chaining into the primary CNI's conflist.
	OwnConflist string
	// OwnedConflist, when set (and OwnConflist is not), is the file name of
	// a conflist the installer owns: the primary CNI's configuration (the
	// first other file that parses) with our plugin appended. Runtimes pick
	// the first file by name, so it must sort before the primary's; it stays
	// on disk across a reboot, so pods that start before the agent still
	// run our plugin, and the primary rewriting its own file never
	// unchains it. Empty: chain into the primary's file in place.
	OwnedConflist string
	// CNIVersion of the own conflist. Default 1.0.0.
	CNIVersion string
	// Plugin holds the plugin's settings in its conflist entry. Its
	// Kubeconfig is set from KubeconfigPath.
	Plugin plugin.Settings

	// KubeconfigPath is where the plugin's kubeconfig is written (host path,
	// passed to the plugin as "kubeconfig"). Empty: no kubeconfig (standalone).
	KubeconfigPath string
	// KubeconfigHostPath is the same file as the plugin on the host sees it,
	// when the agent sees host directories elsewhere (a container mounting
	// /etc/cni/net.d at /host/etc/cni/net.d). Empty: KubeconfigPath.
	KubeconfigHostPath string
	// APIServer is the API server URL as the host sees it.
	APIServer string
	// TokenPath and CAPath are the agent's service-account token and CA.
	TokenPath string
	CAPath    string

	// Debounce coalesces bursts of file events. Default 100ms.
	Debounce time.Duration
	Log      *slog.Logger
	// OnResult, when set, is told the outcome of install passes as
	// istio-cni's istio_cni_installs_total{result} names them: ResultSuccess
	// each time a pass makes the installation ready after it was not, and
	// the failing step's result each time a pass fails, except while the
	// primary CNI has written no configuration to chain into yet (a node
	// coming up). It must not block.
	OnResult func(result string)
}

// Results of install passes (Config.OnResult), istio-cni's values.
const (
	ResultSuccess                 = "SUCCESS"
	ResultCopyBinariesFailure     = "COPY_BINARIES_FAILURE"
	ResultCreateKubeconfigFailure = "CREATE_KUBECONFIG_FAILURE"
	ResultCreateCNIConfigFailure  = "CREATE_CNI_CONFIG_FAILURE"
)

// Results lists every result OnResult may be told, success first.
func Results() []string {
	return []string{ResultSuccess, ResultCopyBinariesFailure, ResultCreateKubeconfigFailure, ResultCreateCNIConfigFailure}
}

// ErrNoPrimaryConfig is returned by a pass while the configuration
// directory holds no CNI configuration to chain into.
var ErrNoPrimaryConfig = errors.New("no cni configuration to chain into yet")

// stepError names the install step that failed, as a Result.
type stepError struct {
	result string
	err    error
}

func (e *stepError) Error() string { return e.err.Error() }
func (e *stepError) Unwrap() error { return e.err }

func step(result string, err error) error {
	if err == nil {
		return nil
	}
	return &stepError{result: result, err: err}
}

// Installer installs and watches. Its methods are safe for concurrent use.
type Installer struct {
	cfg   Config
	log   *slog.Logger
	mu    sync.Mutex // serialises install passes and cleanup
	ready atomic.Bool
}

// New returns an installer for cfg.
func New(cfg Config) *Installer {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.CNIVersion == "" {
		cfg.CNIVersion = "1.0.0"
	}
	if cfg.Debounce == 0 {
		cfg.Debounce = 100 * time.Millisecond
	}
	return &Installer{cfg: cfg, log: cfg.Log.With("component", "cni-install")}
}

// Ready reports whether the last install pass put everything in place.
func (i *Installer) Ready() bool { return i.ready.Load() }

// Install makes one idempotent pass: binaries, kubeconfig, conflist. Files
// already right are not rewritten, so a pass triggers no further events.
func (i *Installer) Install(ctx context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	err := i.install(ctx)
	wasReady := i.ready.Swap(err == nil)
	if i.cfg.OnResult != nil {
		var se *stepError
		switch {
		case err == nil && !wasReady:
			i.cfg.OnResult(ResultSuccess)
		case errors.As(err, &se) && !errors.Is(err, ErrNoPrimaryConfig) && ctx.Err() == nil:
			i.cfg.OnResult(se.result)
		}
	}
	return err
}

// binaries are the files installed into each bin directory: the plugin
// and the fallback it execs when the agent cannot be reached.
func (i *Installer) binaries() map[string]string {
	return map[string]string{
		PluginType:          i.cfg.PluginBinary,
		fallback.BinaryName: filepath.Join(filepath.Dir(i.cfg.PluginBinary), fallback.BinaryName),
	}
}

func (i *Installer) install(ctx context.Context) error {
	if err := step(ResultCopyBinariesFailure, i.installBinaries(ctx)); err != nil {
		return err
	}
	if i.cfg.KubeconfigPath != "" {
		kc, err := i.kubeconfig()
		if err == nil {
			if err = writeIfChanged(i.cfg.KubeconfigPath, kc, 0o600); err != nil {
				err = fmt.Errorf("write plugin kubeconfig: %w", err)
			}
		}
		if err := step(ResultCreateKubeconfigFailure, err); err != nil {
			return err
		}
	}
	return step(ResultCreateCNIConfigFailure, i.installConf())
}

func (i *Installer) installBinaries(ctx context.Context) error {
	for name, src := range i.binaries() {
		bin, err := os.ReadFile(src)
		if err != nil {
			return fmt.Errorf("read %s binary: %w", name, err)
		}
		for _, dir := range i.cfg.BinDirs {
			if err := ctx.Err(); err != nil {
				return err
			}
			// A younger temp file may be another agent's copy in
			// progress (two pods of the DaemonSet overlapping).
			removeTempFilesOlder(dir, name, time.Minute, i.log)
			if err := writeIfChanged(filepath.Join(dir, name), bin, 0o755); err != nil {
				return fmt.Errorf("install %s binary: %w", name, err)
			}
		}
	}
	return nil
}

// entry is our conflist entry.
func (i *Installer) entry() (map[string]any, error) {
	s := i.cfg.Plugin
	s.Kubeconfig = i.cfg.KubeconfigPath
	if i.cfg.KubeconfigHostPath != "" {
		s.Kubeconfig = i.cfg.KubeconfigHostPath
	}
	raw, err := json.Marshal(s)
	if err != nil {
		return nil, fmt.Errorf("encode plugin settings: %w", err)
	}
	e := map[string]any{}
	if err := json.Unmarshal(raw, &e); err != nil {
		return nil, fmt.Errorf("encode plugin settings: %w", err)
	}
	e["type"] = PluginType
	return e, nil
}

func (i *Installer) installConf() error {
	entry, err := i.entry()
	if err != nil {
		return err
	}
	if i.cfg.OwnConflist != "" {
		data, err := withPlugin([]byte(fmt.Sprintf(`{"cniVersion":%q,"name":"ambient-ebpf","plugins":[]}`, i.cfg.CNIVersion)), entry, "")
		if err != nil {
			return fmt.Errorf("build own conflist: %w", err)
		}
		path := filepath.Join(i.cfg.ConfDir, i.cfg.OwnConflist)
		if err := writeIfChanged(path, data, 0o644); err != nil {
			return fmt.Errorf("write own conflist: %w", err)
		}
		return nil
	}
	if i.cfg.OwnedConflist != "" {
		return i.installOwned(entry, true)
	}
	files, err := confFiles(i.cfg.ConfDir)
	if err != nil {
		return err
	}
	target, data, err := i.primary(files, "")
	if err != nil {
		return err
	}
	written, err := i.chainInto(target, data, entry)
	if err != nil {
		return err
	}
	// Our entry lives only in the highest-priority file: take it out of any
	// other file an earlier pass chained into, after the new one has it.
	for _, f := range files {
		if f != target && f != written {
			if _, err := i.removeFrom(f); err != nil {
				return err
			}
		}
	}
	return nil
}

// primary finds the primary CNI's configuration: the first file by name,
// other than skip, that parses and is not an owned conflist. Unparsable
// files are skipped as CRI-O and libcni skip them (a primary caught
// mid-write is re-read on its next write); when nothing is left the error
// names them.
func (i *Installer) primary(files []string, skip string) (string, []byte, error) {
	var skipped []string
	for _, f := range files {
		if f == skip {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			return "", nil, fmt.Errorf("read cni conf %s: %w", f, err)
		}
		d, err := parseDocument(b)
		if err != nil {
			i.log.Warn("skipping unparsable cni conf", "file", f, "error", err)
			skipped = append(skipped, fmt.Sprintf("%s (%v)", f, err))
			continue
		}
		if d.isOwned() {
			continue // an owned conflist of another name: removed once ours is written
		}
		return f, b, nil
	}
	if len(skipped) > 0 {
		return "", nil, fmt.Errorf("%s: %w; unparsable: %s", i.cfg.ConfDir, ErrNoPrimaryConfig, strings.Join(skipped, ", "))
	}
	return "", nil, fmt.Errorf("%s: %w", i.cfg.ConfDir, ErrNoPrimaryConfig)
}

// installOwned writes the owned conflist from the primary's file, then
// removes every other trace of us (owned conflists of other names, entries
// chained in place) so exactly one file names our plugin. The owned file
// is written first: at no point does the file runtimes select lack us.
// Unchaining in place can turn the primary's file back into a lone conf;
// again re-syncs from it once.
func (i *Installer) installOwned(entry map[string]any, again bool) error {
	files, err := confFiles(i.cfg.ConfDir)
	if err != nil {
		return err
	}
	owned := filepath.Join(i.cfg.ConfDir, i.cfg.OwnedConflist)
	// Runtimes ignore temp files (no .conf/.conflist/.json suffix); one
	// left by a write a reboot cut short is removed once surely stale.
	removeTempFilesOlder(i.cfg.ConfDir, i.cfg.OwnedConflist, time.Minute, i.log)
	if old, err := os.ReadFile(owned); err == nil {
		// An unparsable file of that name is ours caught mid-write (the
		// rename is atomic, but a foreign writer or a disk error is
		// not): repaired below. One that parses but is not marked ours
		// is another's, never overwritten.
		if d, err := parseDocument(old); err == nil && !d.isOwned() {
			return fmt.Errorf("owned cni conflist %s: the file exists and is not ours", owned)
		} else if err != nil {
			i.log.Warn("repairing unparsable owned cni conflist", "file", owned, "error", err)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("read owned cni conflist %s: %w", owned, err)
	}
	target, data, err := i.primary(files, owned)
	if err != nil {
		return err
	}
	if target < owned {
		return fmt.Errorf("owned cni conflist %s does not sort before the primary's %s, which runtimes would select: name it to sort first", owned, target)
	}
	out, err := ownedList(data, entry, filepath.Base(target))
	if err != nil {
		return fmt.Errorf("build owned cni conflist from %s: %w", target, err)
	}
	if err := writeIfChanged(owned, out, 0o644); err != nil {
		return fmt.Errorf("write owned cni conflist: %w", err)
	}
	changed := false
	for _, f := range files {
		if f == owned {
			continue
		}
		c, err := i.removeFrom(f)
		if err != nil {
			return err
		}
		changed = changed || c
	}
	if changed && again {
		return i.installOwned(entry, false)
	}
	return nil
}

// chainInto adds our entry to target, converting a lone conf to a conflist,
// and returns the file that now holds it.
func (i *Installer) chainInto(target string, data []byte, entry map[string]any) (string, error) {
	d, _ := parseDocument(data)
	if d.isList() {
		out, err := withPlugin(data, entry, "")
		if err != nil {
			return "", fmt.Errorf("chain into %s: %w", target, err)
		}
		if err := writeIfChanged(target, out, 0o644); err != nil {
			return "", fmt.Errorf("chain into %s: %w", target, err)
		}
		return target, nil
	}
	list := convertedName(target)
	if existing, err := os.ReadFile(list); err == nil {
		// Ours from an earlier conversion (the primary CNI has since
		// rewritten its .conf): convert again. Anything else is not ours.
		if _, from, _, err := withoutPlugin(existing, PluginType, filepath.Base(list)); err != nil || from != filepath.Base(target) {
			return "", fmt.Errorf("convert %s: %s already exists", target, list)
		}
	}
	out, err := withPlugin(data, entry, filepath.Base(target))
	if err != nil {
		return "", fmt.Errorf("convert %s: %w", target, err)
	}
	if err := writeIfChanged(list, out, 0o644); err != nil {
		return "", fmt.Errorf("convert %s: %w", target, err)
	}
	if err := os.Remove(target); err != nil {
		return "", fmt.Errorf("convert %s: remove the lone conf: %w", target, err)
	}
	i.log.Info("converted a lone cni conf into a conflist", "from", target, "to", list)
	return list, nil
}

// removeFrom takes our entry out of one conf file, restoring a lone .conf the
// installer had converted, and removes an owned conflist (of any name: a
// configuration that named another). Files without our entry are left
// alone. It reports whether it changed anything.
func (i *Installer) removeFrom(path string) (bool, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read cni conf %s: %w", path, err)
	}
	if d, err := parseDocument(data); err == nil && d.isOwned() {
		if err := removeFile(path); err != nil {
			return false, fmt.Errorf("remove owned cni conflist: %w", err)
		}
		i.log.Info("removed an owned cni conflist", "file", path)
		return true, nil
	}
	out, restoreAs, changed, err := withoutPlugin(data, PluginType, filepath.Base(path))
	if err != nil || !changed {
		return false, nil // not ours to fix
	}
	if restoreAs != "" {
		orig := filepath.Join(filepath.Dir(path), restoreAs)
		if err := writeIfChanged(orig, out, 0o644); err != nil {
			return false, fmt.Errorf("restore %s: %w", orig, err)
		}
		if err := os.Remove(path); err != nil {
			return false, fmt.Errorf("remove converted %s: %w", path, err)
		}
		return true, nil
	}
	if err := writeIfChanged(path, out, 0o644); err != nil {
		return false, fmt.Errorf("unchain from %s: %w", path, err)
	}
	return true, nil
}

// kubeconfig builds the plugin's kubeconfig from the service-account token.
func (i *Installer) kubeconfig() ([]byte, error) {
	token, err := os.ReadFile(i.cfg.TokenPath)
	if err != nil {
		return nil, fmt.Errorf("read service-account token: %w", err)
	}
	cluster := &clientcmdapi.Cluster{Server: i.cfg.APIServer}
	if i.cfg.CAPath != "" {
		ca, err := os.ReadFile(i.cfg.CAPath)
		if err != nil {
			return nil, fmt.Errorf("read service-account ca: %w", err)
		}
		cluster.CertificateAuthorityData = ca
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["local"] = cluster
	cfg.AuthInfos[PluginType] = &clientcmdapi.AuthInfo{Token: strings.TrimSpace(string(token))}
	cfg.Contexts[PluginType] = &clientcmdapi.Context{Cluster: "local", AuthInfo: PluginType}
	cfg.CurrentContext = PluginType
	out, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, fmt.Errorf("encode plugin kubeconfig: %w", err)
	}
	return out, nil
}

// Cleanup removes what the installer adds and nothing else: our conflist
// entry (restoring a converted .conf), the own or owned conflist, the plugin binaries
// and the kubeconfig. Errors are collected; every step is tried.
func (i *Installer) Cleanup() error {
	i.mu.Lock()
	defer i.mu.Unlock()
	i.ready.Store(false)
	var errs []error
	if i.cfg.OwnConflist != "" {
		errs = append(errs, removeFile(filepath.Join(i.cfg.ConfDir, i.cfg.OwnConflist)))
	} else {
		if i.cfg.OwnedConflist != "" {
			// First, so the primary's own file is selected again; by
			// name, as a corrupt one is ours too.
			errs = append(errs, removeFile(filepath.Join(i.cfg.ConfDir, i.cfg.OwnedConflist)))
			removeTempFiles(i.cfg.ConfDir, i.cfg.OwnedConflist, i.log)
		}
		if files, err := confFiles(i.cfg.ConfDir); err != nil {
			errs = append(errs, err)
		} else {
			for _, f := range files {
				_, err := i.removeFrom(f)
				errs = append(errs, err)
			}
		}
	}
	for _, dir := range i.cfg.BinDirs {
		for name := range i.binaries() {
			removeTempFiles(dir, name, i.log)
			errs = append(errs, removeFile(filepath.Join(dir, name)))
		}
	}
	if i.cfg.KubeconfigPath != "" {
		errs = append(errs, removeFile(i.cfg.KubeconfigPath))
	}
	return errors.Join(errs...)
}

// Run installs, then watches the bin directories, the conf directory and the
// token's directory and repairs drift until ctx ends. A failed pass leaves
// the installer not ready and is retried on the next event or after a second.
func (i *Installer) Run(ctx context.Context) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("create file watcher: %w", err)
	}
	defer w.Close()
	dirs := append([]string{i.cfg.ConfDir}, i.cfg.BinDirs...)
	if i.cfg.KubeconfigPath != "" {
		dirs = append(dirs, filepath.Dir(i.cfg.TokenPath))
	}
	for _, d := range dirs {
		if err := w.Add(d); err != nil {
			return fmt.Errorf("watch %s: %w", d, err)
		}
	}
	const retry = time.Second
	timer := time.NewTimer(0) // first pass right away
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-w.Events:
			if !ok {
				return errors.New("file watcher closed")
			}
			i.log.Debug("cni install drift check", "event", ev.String())
			timer.Reset(i.cfg.Debounce)
		case err, ok := <-w.Errors:
			if !ok {
				return errors.New("file watcher closed")
			}
			i.log.Warn("file watcher error", "error", err)
			timer.Reset(i.cfg.Debounce)
		case <-timer.C:
			if err := i.Install(ctx); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				i.log.Warn("cni install not in place yet", "error", err)
				timer.Reset(retry)
			}
		}
	}
}

// writeIfChanged atomically replaces path with data (temp file in the same
// directory, fsync, rename) unless it already holds exactly that.
func writeIfChanged(path string, data []byte, mode os.FileMode) error {
	if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, data) {
		if fi, err := os.Stat(path); err == nil && fi.Mode().Perm() == mode {
			return nil
		}
	}
	return atomicWrite(path, bytes.NewReader(data), mode)
}

func atomicWrite(path string, r io.Reader, mode os.FileMode) error {
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		return err
	}
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp."+hex.EncodeToString(b[:]))
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return fmt.Errorf("create %s: %w", tmp, err)
	}
	_, err = io.Copy(f, r)
	if err == nil {
		err = f.Chmod(mode)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// removeTempFiles deletes temp files an interrupted atomicWrite of the
// binary name left behind.
func removeTempFiles(dir, name string, log *slog.Logger) { removeTempFilesOlder(dir, name, 0, log) }

// removeTempFilesOlder deletes those last modified more than age ago: a
// younger one may be another installer's write in progress.
func removeTempFilesOlder(dir, name string, age time.Duration, log *slog.Logger) {
	matches, _ := filepath.Glob(filepath.Join(dir, "."+name+".tmp.*"))
	for _, m := range matches {
		if fi, err := os.Stat(m); age > 0 && (err != nil || time.Since(fi.ModTime()) < age) {
			continue
		}
		if err := os.Remove(m); err != nil {
			log.Warn("remove leftover temp file", "file", m, "error", err)
		}
	}
}

func removeFile(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", path, err)
	}
	return nil
}
