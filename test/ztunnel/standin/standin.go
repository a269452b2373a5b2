// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package standin is a ztunnel for tests and the demo, faithful to the real
// one where the kernel can see it: for each pod it opens, inside the pod's
// netns, the sockets ztunnel opens (wildcard listeners on 15001, 15006 and
// 15008 with IP_TRANSPARENT; every socket with SO_MARK 0x539 and
// SO_REUSEPORT), learns original destinations with SO_ORIGINAL_DST (falling
// back to the local address), relays TCP with marked sockets, and records
// every connection it handled as a JSON line.
package standin

import (
	"golang.org/x/sys/unix"

	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
)

// The ports and mark of the ambient contract.
const (
	OutboundPort = 15001
	InboundPort  = 15006
	HBONEPort    = 15008
	Mark         = 0x539
)

// Record is one connection the stand-in handled.
type Record struct {
	Time        time.Time      `json:"time"`
	Pod         string         `json:"pod"`
	Listener    int            `json:"listener"`
	Peer        netip.AddrPort `json:"peer"`
	Local       netip.AddrPort `json:"local"`
	OrigDst     netip.AddrPort `json:"origDst"`
	OrigDstFrom string         `json:"origDstFrom,omitempty"` // SO_ORIGINAL_DST or local
	DNSName     string         `json:"dnsName,omitempty"`
	DNSUpstream bool           `json:"dnsUpstream,omitempty"` // answered by the upstream server
	Error       string         `json:"error,omitempty"`
}

// Reply is what the stand-in's HBONE listener answers; the test apps answer
// in the same shape, so a client can tell who it reached.
type Reply struct {
	Server string         `json:"server"`
	Local  netip.AddrPort `json:"local"`
	Peer   netip.AddrPort `json:"peer"`
}

// Config configures the stand-in.
type Config struct {
	// Records receives one JSON line per connection; nil discards them.
	Records io.Writer
	// Transcript receives one JSON line (zdsclient.Observed) per ZDS
	// request as it arrived; nil discards them.
	Transcript io.Writer
	// PlainInbound delivers inbound traffic to the app from the pod's own
	// address. By default the client's address is kept (IP_TRANSPARENT +
	// IP_FREEBIND + bind), as ztunnel does, which needs the
	// original-source return path (R10).
	PlainInbound bool
	// DNS configures the DNS proxy on 127.0.0.1:15053 and [::1]:15053.
	DNS DNS
	// AckDelay holds every ZDS answer that long (a ztunnel slow to ack);
	// NackAdds refuses that many AddWorkloads first (ztunnel NACKs a pod
	// it could not set up), then acks as usual.
	AckDelay time.Duration
	NackAdds int
	Logger   *slog.Logger
}

// Proxy serves any number of pods.
type Proxy struct {
	cfg   Config
	log   *slog.Logger
	recMu sync.Mutex

	mu   sync.Mutex
	pods map[string]*pod
	zds  interface{ Drop() bool } // ServeZDS's client, once it runs
}

type pod struct {
	uid       string
	netnsID   [2]uint64 // (device, inode): how ztunnel tells netns apart (Z9)
	ns        *sockutil.Netns
	listeners []net.Listener
	closers   []io.Closer
	wg        sync.WaitGroup
}

// New returns a stand-in with no pods.
func New(cfg Config) *Proxy {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Proxy{cfg: cfg, log: cfg.Logger, pods: map[string]*pod{}}
}

// AddPod opens the pod's listeners inside netns. Adding a pod again
// replaces its listeners. An error means ztunnel would NACK.
func (p *Proxy) AddPod(uid string, netns *os.File) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(netns.Fd()), &st); err != nil {
		return fmt.Errorf("pod %s: stat netns: %w", uid, err)
	}
	id := [2]uint64{st.Dev, st.Ino}
	// A repeated Add for the same netns (a restarted agent's snapshot) is
	// harmless, as with ztunnel (Z9): the pod's listeners stay, and so do
	// the connections waiting in their accept queues.
	p.mu.Lock()
	same := p.pods[uid] != nil && p.pods[uid].netnsID == id
	p.mu.Unlock()
	if same {
		return nil
	}
	ns, err := sockutil.EnterNetns(netns)
	if err != nil {
		return fmt.Errorf("pod %s: enter netns: %w", uid, err)
	}
	pd := &pod{uid: uid, netnsID: id, ns: ns}
	opts := sockutil.Opts{Mark: Mark, ReusePort: true, Transparent: true}
	for _, port := range []uint16{OutboundPort, InboundPort, HBONEPort} {
		l, err := ns.Listen(netip.AddrPortFrom(netip.IPv6Unspecified(), port), opts)
		if err != nil {
			pd.close()
			return fmt.Errorf("pod %s: %w", uid, err)
		}
		pd.listeners = append(pd.listeners, l)
	}
	if err := p.serveDNS(pd); err != nil {
		pd.close()
		return fmt.Errorf("pod %s: dns proxy: %w", uid, err)
	}
	p.mu.Lock()
	old := p.pods[uid]
	p.pods[uid] = pd
	p.mu.Unlock()
	if old != nil {
		old.close()
	}
	for i, port := range []int{OutboundPort, InboundPort, HBONEPort} {
		l := pd.listeners[i]
		pd.wg.Add(1)
		go func() {
			defer pd.wg.Done()
			p.serve(pd, l, port)
		}()
	}
	p.log.Info("pod added", "uid", uid)
	return nil
}

// DelPod closes the pod's listeners.
func (p *Proxy) DelPod(uid string) {
	p.mu.Lock()
	pd := p.pods[uid]
	delete(p.pods, uid)
	p.mu.Unlock()
	if pd != nil {
		pd.close()
		p.log.Info("pod removed", "uid", uid)
	}
}

// Pods returns the uids served.
func (p *Proxy) Pods() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	uids := make([]string, 0, len(p.pods))
	for uid := range p.pods {
		uids = append(uids, uid)
	}
	return uids
}

// Close stops serving every pod.
func (p *Proxy) Close() {
	p.mu.Lock()
	pods := p.pods
	p.pods = map[string]*pod{}
	p.mu.Unlock()
	for _, pd := range pods {
		pd.close()
	}
}

func (pd *pod) close() {
	for _, l := range pd.listeners {
		l.Close()
	}
	for _, c := range pd.closers {
		c.Close()
	}
	pd.wg.Wait()
	pd.ns.Close()
}

func (p *Proxy) serve(pd *pod, l net.Listener, port int) {
	for {
		c, err := l.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				p.log.Warn("accept failed", "pod", pd.uid, "port", port, "error", err)
			}
			return
		}
		go p.handle(pd, c, port)
	}
}

func (p *Proxy) handle(pd *pod, c net.Conn, port int) {
	defer c.Close()
	rec := Record{Time: time.Now(), Pod: pd.uid, Listener: port,
		Peer: sockutil.AddrPort(c.RemoteAddr()), Local: sockutil.AddrPort(c.LocalAddr())}
	if port == HBONEPort {
		// HBONE termination is out of scope: answer who was reached.
		rec.OrigDst, rec.OrigDstFrom = rec.Local, "local"
		p.record(rec)
		_ = json.NewEncoder(c).Encode(Reply{Server: "ztunnel-hbone", Local: rec.Local, Peer: rec.Peer})
		return
	}
	dst, from, err := sockutil.OriginalDst(c)
	rec.OrigDst, rec.OrigDstFrom = dst, from
	if err == nil && dst.Port() == uint16(port) && (dst.Addr() == rec.Local.Addr() || from == "local" && port == OutboundPort) {
		err = fmt.Errorf("original destination %s is the listener itself", dst)
	}
	var up net.Conn
	if err == nil {
		opts := sockutil.Opts{Mark: Mark, ReusePort: true}
		if port == InboundPort && !p.cfg.PlainInbound {
			opts.Transparent, opts.FreeBind = true, true
			opts.Bind = netip.AddrPortFrom(rec.Peer.Addr(), 0)
		}
		up, err = pd.ns.Dial(dst, opts, 5*time.Second)
	}
	if err != nil {
		rec.Error = err.Error()
		p.record(rec)
		return
	}
	defer up.Close()
	p.record(rec)
	relay(c, up)
}

// relay copies both ways until both directions are done. It reads and
// writes through a buffer, as ztunnel does (its copy_buf), never with
// splice(2) (what io.Copy between two TCP connections does): the kernel can
// see the difference, and splice misses bytes a sockmap redirected onto a
// socket (dataplane.Config.SockmapAccel).
func relay(a, b net.Conn) {
	var wg sync.WaitGroup
	wg.Add(2)
	cp := func(dst, src net.Conn) {
		defer wg.Done()
		buf := make([]byte, 64<<10)
		_, _ = io.CopyBuffer(struct{ io.Writer }{dst}, struct{ io.Reader }{src}, buf)
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
	}
	go cp(a, b)
	go cp(b, a)
	wg.Wait()
}

func (p *Proxy) record(r Record) {
	if p.cfg.Records == nil {
		return
	}
	b, _ := json.Marshal(r)
	p.recMu.Lock()
	defer p.recMu.Unlock()
	_, _ = p.cfg.Records.Write(append(b, '\n'))
}
