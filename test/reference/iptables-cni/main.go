// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Command iptables-cni is the benchmarks' istio-cni: a chained CNI plugin
// that enrolls a pod the way istio-cni does in iptables mode (contract
// sections 2 and 3), from the same kind of exec as ambient-ebpf-cni, so
// both enrolment paths include a process start. On ADD it adds the pod's
// IPs to the node's ipsets by netlink (in the netns it runs in, the node's),
// runs iptables-restore and ip6tables-restore with the in-pod rules inside
// the pod's netns, and adds the return path's policy rule and local route
// there by netlink, then passes the previous result on. DEL takes the IPs
// out of the ipsets (the pod's netns, and the rules in it, are going away).
//
// Unlike istio-cni it does the work in the plugin process: there is no hop
// to a node agent and nothing is handed to ztunnel. Test-only.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"runtime"
	"strings"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference/rules"
)

func main() {
	skel.PluginMainFuncs(skel.CNIFuncs{Add: cmdAdd, Del: cmdDel, Check: func(*skel.CmdArgs) error { return nil }},
		version.PluginSupports("0.4.0", "1.0.0", "1.1.0"), "iptables-cni: istio-cni's in-pod iptables enrolment, for the benchmarks")
}

// conf is the plugin's conflist entry as the runtime passes it.
type conf struct {
	types.PluginConf
	// DNSCapture adds the DNS rules (R9), as istio-cni does by default.
	DNSCapture bool `json:"dnsCapture,omitempty"`
}

// parse decodes the stdin; the previous result is nil when there is none.
func parse(args *skel.CmdArgs) (*conf, *current.Result, error) {
	var c conf
	if err := json.Unmarshal(args.StdinData, &c); err != nil {
		return nil, nil, fmt.Errorf("decode network configuration: %w", err)
	}
	if err := version.ParsePrevResult(&c.PluginConf); err != nil {
		return nil, nil, fmt.Errorf("decode prevResult: %w", err)
	}
	if c.PrevResult == nil {
		return &c, nil, nil
	}
	prev, err := current.NewResultFromResult(c.PrevResult)
	if err != nil {
		return nil, nil, fmt.Errorf("convert prevResult: %w", err)
	}
	return &c, prev, nil
}

// podIPs are the prevResult's addresses on interfaces inside the sandbox.
func podIPs(r *current.Result) []net.IP {
	var ips []net.IP
	for _, ip := range r.IPs {
		if ip.Interface != nil && *ip.Interface >= 0 && *ip.Interface < len(r.Interfaces) && r.Interfaces[*ip.Interface].Sandbox == "" {
			continue
		}
		ips = append(ips, ip.Address.IP)
	}
	return ips
}

// podUID reads K8S_POD_UID from CNI_ARGS.
func podUID(cniArgs string) string {
	for _, kv := range strings.Split(cniArgs, ";") {
		if k, v, ok := strings.Cut(kv, "="); ok && k == "K8S_POD_UID" {
			return v
		}
	}
	return ""
}

func ipsetOf(ip net.IP) string {
	if ip.To4() != nil {
		return rules.IpsetV4
	}
	return rules.IpsetV6
}

func cmdAdd(args *skel.CmdArgs) error {
	c, prev, err := parse(args)
	if err != nil {
		return err
	}
	if prev == nil {
		return errors.New("iptables-cni is a chained plugin: no prevResult")
	}
	ips := podIPs(prev)
	uid := podUID(args.Args)
	hasV6 := false
	for _, ip := range ips {
		if err := netlink.IpsetAdd(ipsetOf(ip), &netlink.IPSetEntry{IP: ip, Comment: uid, Replace: true}); err != nil {
			return fmt.Errorf("add %s to ipset %s: %w", ip, ipsetOf(ip), err)
		}
		hasV6 = hasV6 || ip.To4() == nil
	}
	if err := inpod(args.Netns, podopts.Options{DNSCapture: c.DNSCapture}, hasV6); err != nil {
		return err
	}
	return types.PrintResult(prev, c.CNIVersion)
}

// inpod applies the in-pod rules and the return path in the pod's netns.
func inpod(path string, o podopts.Options, hasV6 bool) error {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer ns.Close()
	if err := restore(ns, "iptables-restore", rules.Inpod(o, rules.Loopback4, rules.Probe4)); err != nil {
		return err
	}
	families := []int{unix.AF_INET}
	if hasV6 {
		if err := restore(ns, "ip6tables-restore", rules.Inpod(o, rules.Loopback6, rules.Probe6)); err != nil {
			return err
		}
		families = append(families, unix.AF_INET6)
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("netlink in %s: %w", path, err)
	}
	defer h.Close()
	for _, fam := range families {
		// ip rule add fwmark 0x111/0xfff pref 32764 lookup 100
		rule := netlink.NewRule()
		rule.Family, rule.Mark, rule.Priority, rule.Table = fam, 0x111, 32764, 100
		mask := uint32(0xfff)
		rule.Mask = &mask
		if err := h.RuleAdd(rule); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("add return-path rule: %w", err)
		}
		// ip route replace local 0.0.0.0/0 (::/0) dev lo table 100
		dst := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
		if fam == unix.AF_INET6 {
			dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
		}
		route := &netlink.Route{LinkIndex: 1, Dst: dst, Table: 100, Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST, Family: fam}
		if err := h.RouteReplace(route); err != nil {
			return fmt.Errorf("replace return-path route: %w", err)
		}
	}
	return nil
}

// restore runs tool (iptables-restore or ip6tables-restore) with input
// inside ns: the command starts on a thread switched into the pod's netns,
// as istio-cni runs it.
func restore(ns netns.NsHandle, tool, input string) error {
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("own netns: %w", err)
	}
	defer orig.Close()
	if err := netns.Set(ns); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter pod netns: %w", err)
	}
	cmd := exec.Command(tool, "--noflush")
	cmd.Stdin = strings.NewReader(input)
	out, runErr := cmd.CombinedOutput()
	if err := netns.Set(orig); err != nil {
		// The thread stays locked and dies with the process.
		return fmt.Errorf("return from pod netns: %w", err)
	}
	runtime.UnlockOSThread()
	if runErr != nil {
		return fmt.Errorf("%s in the pod netns: %w: %s", tool, runErr, strings.TrimSpace(string(out)))
	}
	return nil
}

func cmdDel(args *skel.CmdArgs) error {
	_, prev, err := parse(args)
	if err != nil || prev == nil {
		return err // DEL without a previous result has nothing to undo
	}
	for _, ip := range podIPs(prev) {
		if err := netlink.IpsetDel(ipsetOf(ip), &netlink.IPSetEntry{IP: ip}); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("remove %s from ipset %s: %w", ip, ipsetOf(ip), err)
		}
	}
	return nil
}
