// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"errors"
	"fmt"
	"io"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// loadListenerIterator loads ae_file_listeners (bpf/listeners.c), in the
// sk_lookup mode only, over the pinned ae_listeners. It is not pinned: it
// runs at an enrolment, from the agent that loaded it.
func (d *Dataplane) loadListenerIterator() error {
	if !d.skLookupInbound {
		return nil
	}
	spec, err := loadListeners()
	if err != nil {
		return fmt.Errorf("read the listener iterator: %w", err)
	}
	var vars listenersSpecs
	if err := spec.Assign(&vars); err != nil {
		return fmt.Errorf("read the listener iterator: %w", err)
	}
	cfg := d.cfg.bpfConfig()
	cfg.Flags = d.bpfFlags
	if err := vars.AeCfg.Set(cfg); err != nil {
		return fmt.Errorf("configure the listener iterator: %w", err)
	}
	var progs listenersPrograms
	if err := spec.LoadAndAssign(&progs, &ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{"ae_listeners": d.sock.AeListeners}}); err != nil {
		d.logVerifier(err)
		return fmt.Errorf("load the listener iterator: %w", err)
	}
	d.listenerIter = progs.AeFileListeners
	return nil
}

// fileExistingListeners files the inbound listeners ztunnel already has
// in the pod's netns (path, cookie), when none of the pod's is filed (the
// caller runs it for a running pod only: Pod.Running):
// sockops files a listener only as it starts listening, and ztunnel
// listened before this enrolment when it took the pod from istio-cni (a
// takeover) or the pins were lost while it ran. Without the entry the
// pod's sk_lookup program would let inbound connections past ztunnel.
func (d *Dataplane) fileExistingListeners(path string, cookie uint64) error {
	if d.listenerIter == nil {
		return nil
	}
	for i := range uint16(listenerSlots) {
		key := sockListenerKey{NetnsCookie: cookie, Port: DefaultInboundPort, Idx: i}
		var v uint64
		err := d.sock.AeListeners.Lookup(&key, &v)
		if err == nil {
			return nil
		}
		if !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("look up ae_listeners: %w", err)
		}
	}
	it, err := link.AttachIter(link.IterOptions{Program: d.listenerIter})
	if err != nil {
		return fmt.Errorf("attach the listener iterator: %w", err)
	}
	defer it.Close()
	// An iter/tcp walks the netns it is opened in.
	var r io.ReadCloser
	if err := inNetns(path, func() error {
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
