// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/nsexec"
)

// loadListenerIterator loads ae_file_listeners (bpf/listeners.c), in the
// sk_lookup mode only, over the pinned ae_listeners. It is not pinned: it
// runs at an enrolment, from the agent that loaded it.
func (d *Dataplane) loadListenerIterator() error {
	if !d.skLookupInbound {
		return nil
	}
	spec, err := bpfobj.LoadListeners()
	if err != nil {
		return fmt.Errorf("read the listener iterator: %w", err)
	}
	var vars bpfobj.ListenersSpecs
	if err := spec.Assign(&vars); err != nil {
		return fmt.Errorf("read the listener iterator: %w", err)
	}
	cfg := d.cfg.bpfConfig()
	cfg.Flags = d.bpfFlags
	if err := vars.AeCfg.Set(cfg); err != nil {
		return fmt.Errorf("configure the listener iterator: %w", err)
	}
	var progs bpfobj.ListenersPrograms
	if err := spec.LoadAndAssign(&progs, &ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{"ae_listeners": d.sock.AeListeners}, Cache: d.kernelBTF}); err != nil {
		d.logVerifier(err)
		return fmt.Errorf("load the listener iterator: %w", err)
	}
	d.listenerIter = progs.AeFileListeners
	return nil
}

// fileExistingListeners files the inbound listeners ztunnel already has
// in the pod's netns (path, cookie), when none of the pod's is filed.
// sockops files a listener only as it starts listening, and only in an
// enrolled netns (on_listen in bpf/sock.c): ztunnel listened before this
// enrolment when it took the pod from istio-cni (a takeover), the pins
// were lost while it ran, or it listened between the pod's creation and
// its ae_netns entry; a full ae_listeners leaves a listener out too.
// Without the entry the pod's sk_lookup program refuses its inbound
// connections (fail closed).
func (d *Dataplane) fileExistingListeners(path string, cookie uint64) error {
	if d.listenerIter == nil {
		return nil
	}
	if filed, err := listenerFiled(&d.sock.SockMaps, cookie); err != nil || filed {
		return err
	}
	// The iterator walks every TCP socket of the node (about 2 ms with
	// 262144 established-hash buckets); asking sock_diag for listeners
	// only walks the listening hash (under 0.2 ms with the netns switch).
	// Nearly every enrolment finds none: ztunnel is handed a pod after it.
	var listening bool
	if err := nsexec.Do(path, func() (err error) { listening, err = listeningOn(bpfobj.DefaultInboundPort); return err }); err != nil {
		return fmt.Errorf("look for ztunnel's listeners in the pod netns: %w", err)
	}
	if !listening {
		return nil
	}
	it, err := link.AttachIter(link.IterOptions{Program: d.listenerIter})
	if err != nil {
		return fmt.Errorf("attach the listener iterator: %w", err)
	}
	defer it.Close()
	// An iter/tcp walks the netns it is opened in.
	var r io.ReadCloser
	if err := nsexec.Do(path, func() error {
		var err error
		r, err = it.Open()
		return err
	}); err != nil {
		return fmt.Errorf("open the listener iterator in the pod netns: %w", err)
	}
	defer r.Close()
	if _, err := io.Copy(io.Discard, r); err != nil {
		return fmt.Errorf("run the listener iterator: %w", err)
	}
	return nil
}

// listenerFiled reports whether one of ztunnel's inbound listeners of the
// netns is in ae_listeners.
func listenerFiled(m *bpfobj.SockMaps, cookie uint64) (bool, error) {
	for i := range uint16(bpfobj.ListenerSlots) {
		key := bpfobj.SockListenerKey{NetnsCookie: cookie, Port: bpfobj.DefaultInboundPort, Idx: i}
		var v uint64
		err := m.AeListeners.Lookup(&key, &v)
		if err == nil {
			return true, nil
		}
		if !errors.Is(err, ebpf.ErrKeyNotExist) {
			return false, fmt.Errorf("look up ae_listeners: %w", err)
		}
	}
	return false, nil
}

// pruneListeners deletes the ae_listeners entries of netns that are not
// enrolled: a removed pod's (ztunnel closes its listeners only when the
// Del reaches it), and any that sockops filed before it checked the netns
// (pins of an earlier agent, whose sockops filed every marked listener of
// the node: anyone with a user namespace could fill the map). sockops
// files nothing for them again, so the room they took returns.
func (d *Dataplane) pruneListeners() int {
	var ns bpfobj.SockNetnsInfo
	n := pruneEntries(d, d.sock.AeListeners, func(k *bpfobj.SockListenerKey, _ *uint64) bool {
		return errors.Is(d.sock.AeNetns.Lookup(k.NetnsCookie, &ns), ebpf.ErrKeyNotExist)
	})
	if n > 0 {
		d.log.Info("pruned listeners of netns that are not enrolled from ae_listeners", "entries", n)
	}
	return n
}

// ResyncListeners prunes ae_listeners of netns that are not enrolled and
// files the listeners of enrolled pods none of whose is filed (the
// iterator, bpf/listeners.c): a listener the full map left out is filed
// once room returns, not only when ztunnel opens it again. The agent runs
// it periodically. Only the sk_lookup mode (Linux 5.17) files listeners;
// elsewhere it reports an empty status.
func (d *Dataplane) ResyncListeners(ctx context.Context) (inspect.ListenerStatus, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.listenerIter == nil {
		return inspect.ListenerStatus{}, nil
	}
	pruned := d.pruneListeners()
	refiled := 0
	pods := map[uint64]string{}
	for _, st := range d.pods {
		if err := ctx.Err(); err != nil {
			return inspect.ListenerStatus{}, err
		}
		name := st.Namespace + "/" + st.Name
		pods[st.NetnsCookie] = name
		filed, err := listenerFiled(&d.sock.SockMaps, st.NetnsCookie)
		if err != nil {
			return inspect.ListenerStatus{}, err
		}
		if filed || inspect.CheckNetns(st.netnsPath, st.NetnsCookie) != nil {
			continue // a pod whose netns is gone is removed soon
		}
		if err := d.fileExistingListeners(st.netnsPath, st.NetnsCookie); err != nil {
			d.log.Warn("file ztunnel's listeners of an enrolled pod", "pod", name, "error", err)
			continue
		}
		if filed, _ := listenerFiled(&d.sock.SockMaps, st.NetnsCookie); filed {
			d.log.Info("filed ztunnel's inbound listener of an enrolled pod that had none filed", "pod", name)
			refiled++
		}
	}
	status, err := inspect.ReadListenerStatus(&d.sock.SockMaps, pods)
	status.Pruned, status.Refiled = pruned, refiled
	return status, err
}

// inetDiagReq is struct inet_diag_req_v2 asking for the thread netns's
// TCP sockets in the states of the mask (sock_diag, <linux/inet_diag.h>).
type inetDiagReq struct {
	family uint8
	states uint32
}

func (r *inetDiagReq) Len() int { return 56 }

func (r *inetDiagReq) Serialize() []byte {
	b := make([]byte, r.Len())
	b[0] = r.family
	b[1] = unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(b[4:], r.states)
	return b // the socket id (b[8:]) stays zero: a dump matches every socket
}

// listeningOn reports whether a TCP socket of the calling thread's netns
// listens on port. A dump of listeners only (the state mask) never walks
// the established hash.
func listeningOn(port uint16) (bool, error) {
	for _, fam := range []uint8{unix.AF_INET, unix.AF_INET6} {
		req := nl.NewNetlinkRequest(nl.SOCK_DIAG_BY_FAMILY, unix.NLM_F_DUMP)
		req.AddData(&inetDiagReq{family: fam, states: 1 << tcpListenState})
		msgs, err := req.Execute(unix.NETLINK_INET_DIAG, nl.SOCK_DIAG_BY_FAMILY)
		if err != nil {
			return false, fmt.Errorf("sock_diag dump of tcp listeners (family %d): %w", fam, err)
		}
		for _, m := range msgs {
			// struct inet_diag_msg: family, state, timer, retrans,
			// then the socket id, whose source port comes first (big endian).
			if len(m) >= 6 && m[1] == tcpListenState && binary.BigEndian.Uint16(m[4:6]) == port {
				return true, nil
			}
		}
	}
	return false, nil
}

// tcpListenState is TCP_LISTEN (include/net/tcp_states.h).
const tcpListenState = 10
