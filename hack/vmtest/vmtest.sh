#!/usr/bin/env bash
# Copyright ambient-ebpf authors
# SPDX-License-Identifier: Apache-2.0
#
# vmtest.sh KERNEL...: runs the kernel suites (static test binaries of
# $VMTEST_PKGS) on each KERNEL: "host" runs them here, 5.10 / 6.1 / 6.12
# boot Debian's cloud kernel of that series under qemu (software
# emulation) with an initramfs of busybox, the userland tools the suites
# call (iptables of both backends, nft, ipset, ip, nsenter) and the
# binaries. arm64-6.1 / arm64-6.12 boot Debian's arm64 cloud kernel under
# qemu-system-aarch64 (the virt machine) with arm64 test binaries of
# $VMTEST_ARM64_PKGS (default: $VMTEST_PKGS) and Debian's arm64 userland
# (fetch-userland.sh); results come over a virtio console there, the
# machine's one UART being the kernel's console. Each kernel's run ends with "vmtest <release>: N passed,
# N failed, N skipped"; the script fails when any kernel fails, hangs or
# panics (no exit marker).
#
# A VMTEST_PKGS entry PKG:PATTERN runs only PKG's tests matching PATTERN
# (a -test.run pattern); KERNELS@PKG[:PATTERN] runs it only on the
# kernels of the comma-separated KERNELS (names as given on the command
# line: 5.10,6.1), so that one boot per kernel carries everything that
# kernel runs. Packages whose tests run the real agent get
# their binaries prebuilt here (hack/testbins: this tree's agent, its
# next-layout build, the last release's), since the guest has no Go
# toolchain or git; the guest finds them through AMBIENT_EBPF_TEST_BINS.
#
# VMTEST_RUN (a -test.run pattern) narrows the run, for debugging.
# VMTEST_GUEST_SKIP (a -test.skip pattern) leaves tests out of the guests
# only, never the host: by default the listener flood, whose 8200 netns
# and 32800 listeners of an unprivileged user would take minutes and much
# of the guest's memory under software emulation. The sockops check it
# proves is the same object on every kernel that files listeners; the
# host leg and make test run it. AMBIENT_EBPF_GUEST=1 tells the suites
# they run emulated: the conformance rows then leave out the per-pod
# socket hooks' pass (see test/conformance's backends).
# CI is passed into the guest, so the suites keep CI=true semantics
# there: only documented kernel-floor skips (see docs/KERNELS.md's
# feature table) are allowed, every other skip fails.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
GO=${GO:-go}
CACHE=${CACHE:-$root/.cache}
VMTEST_PKGS=${VMTEST_PKGS:-./pkg/features ./pkg/dataplane ./test/conformance}
VMTEST_ARM64_PKGS=${VMTEST_ARM64_PKGS:-$VMTEST_PKGS}
VMTEST_TIMEOUT=${VMTEST_TIMEOUT:-3600} # seconds per VM, boot to poweroff
VMTEST_MEM=${VMTEST_MEM:-2G}         # the initramfs (binaries included) lives in it
# vCPUs per guest, each a host thread (multi-threaded TCG): with one vCPU the
# suites' 200-connections-at-once scenario can outlast its 5 s dial timeout.
VMTEST_SMP=${VMTEST_SMP:-2}
VMTEST_GUEST_SKIP=${VMTEST_GUEST_SKIP-TestListenerFloodFromAUserNamespace}
vcache=$CACHE/vmtest
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

log() { echo "vmtest: $*" >&2; }

# karch KERNEL: the guest's architecture; kseries KERNEL: its series.
karch() { case $1 in arm64-*) echo arm64 ;; *) echo amd64 ;; esac; }
kseries() { echo "${1#arm64-}"; }

# asked ARCH KERNELS: whether a kernel of this run (run_kernels) of
# architecture ARCH is among the comma-separated KERNELS.
asked() {
	local k
	for k in $run_kernels; do
		[ "$(karch "$k")" = "$1" ] || continue
		case ",$2," in *",$k,"*) return 0 ;; esac
	done
	return 1
}

# build_tests [ARCH]: the test binaries, into $work/tests (amd64, the
# default) or $work/tests.arm64.
build_tests() {
	local arch=${1:-amd64} dir=$work/tests pkgs=$VMTEST_PKGS
	[ "$arch" = amd64 ] || dir=$work/tests.$arch pkgs=$VMTEST_ARM64_PKGS
	mkdir -p "$dir"
	local entry pkg run name kernels
	for entry in $pkgs; do
		kernels=""
		case $entry in *@*) kernels=${entry%%@*} entry=${entry#*@} ;; esac
		# Left out: what no kernel of this run and this architecture asks for.
		[ -z "$kernels" ] || asked "$arch" "$kernels" || continue
		pkg=${entry%%:*} run=""
		[ "$pkg" = "$entry" ] || run=${entry#*:}
		name=$(echo "${pkg#./}" | tr / _)
		if [ -e "$dir/$name.test" ]; then
			log "$pkg is named twice in the package list: one entry per package"
			exit 2
		fi
		(cd "$root" && CGO_ENABLED=0 GOARCH=$arch $GO test -c -o "$dir/$name.test" "$pkg")
		(cd "$root" && $GO list -f '{{.ImportPath}}' "$pkg") >"$dir/$name.test.pkg"
		(cd "$root" && $GO list -f '{{.Dir}}' "$pkg") >"$work/dir.$name"
		[ -z "$run" ] || echo "$run" >"$dir/$name.test.run"
		[ -z "$kernels" ] || echo "$kernels" | tr , '\n' >"$dir/$name.test.kernels"
		if [ "$arch" != amd64 ] && { [ "$pkg" = ./test/agente2e ] || [ "$pkg" = ./test/takeover ]; }; then
			log "$pkg needs prebuilt agent binaries, built for amd64 only: not on $arch"
			exit 2
		fi
		if { [ "$pkg" = ./test/agente2e ] || [ "$pkg" = ./test/takeover ]; } && [ ! -d "$work/bins" ]; then
			(cd "$root" && $GO run ./hack/testbins -o "$work/bins")
		fi
	done
	$GO build -o "$work/testreport" "$root/hack/testreport"
}

# summarize LABEL: test2json-ready output with VMTEST markers on stdin ->
# the test report, ending with "vmtest LABEL: N passed, ...". Fails when
# the run did not reach its exit marker.
summarize() {
	local label=$1
	local raw=$work/raw.$label
	tr -d '\r' >"$raw"
	awk -v dir="$work" -v label="$label" '
		/^VMTEST-PKG / { pkg = $2; f = dir "/pkg." label "." ++n; print pkg > (f ".name"); next }
		/^VMTEST-PKGEXIT / { close(f); f = ""; next }
		/^VMTEST-/ { next }
		f != "" { print > f }
	' "$raw"
	local f rc=0
	for f in "$work/pkg.$label".*.name; do
		[ -e "$f" ] || continue
		$GO tool test2json -p "$(cat "$f")" <"${f%.name}" || true
	done | "$work/testreport" | sed -E "s/^testreport: ([0-9]+ passed)/vmtest $label: \1/" || rc=1
	if ! grep -q '^VMTEST-EXIT 0$' "$raw"; then
		grep -q '^VMTEST-EXIT ' "$raw" || log "$label: no exit marker: the guest panicked, hung or timed out"
		rc=1
	fi
	return $rc
}

run_host() {
	local rel t rc=0
	rel=$(uname -r)
	for t in "$work"/tests/*.test; do
		[ ! -e "$t.kernels" ] || grep -qx host "$t.kernels" || continue
		echo "VMTEST-PKG $(cat "$t.pkg")"
		local run=${VMTEST_RUN:-}
		[ -n "$run" ] || [ ! -e "$t.run" ] || run=$(cat "$t.run")
		(cd "$(cat "$work/dir.$(basename "$t" .test)")" && "$t" -test.v=test2json -test.count=1 -test.timeout=20m ${run:+-test.run "$run"} 2>&1) || rc=1
		echo "VMTEST-PKGEXIT"
	done >"$work/host.out"
	echo "VMTEST-EXIT $rc" >>"$work/host.out"
	summarize "$rel" <"$work/host.out"
}

# Userland shared by every guest: busybox, the tools the suites run and
# their shared libraries, the test binaries.
build_base() {
	local base=$work/base bin lib
	[ -e "$work/base.cpio" ] && return
	mkdir -p "$base"/{bin,sbin,usr/bin,usr/sbin,lib,lib64,etc,proc,sys,dev,tmp,run,tests}
	cp /bin/busybox "$base/bin/busybox"
	ln -s busybox "$base/bin/sh"
	ln -s ../bin/busybox "$base/sbin/modprobe"
	cp "$here/init" "$base/init"
	cp "$work"/tests/* "$base/tests/"
	[ ! -d "$work/bins" ] || cp -a "$work/bins" "$base/bins"
	local tools="ip nsenter ipset nft xtables-nft-multi xtables-legacy-multi"
	for bin in $tools; do
		cp "$(command -v "$bin")" "$base/usr/sbin/$bin"
		for lib in $(ldd "$(command -v "$bin")" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $1 !~ /:$/ {print $1}'); do
			mkdir -p "$base$(dirname "$lib")"
			cp -L "$lib" "$base$lib"
		done
	done
	for bin in iptables ip6tables iptables-restore ip6tables-restore iptables-save ip6tables-save iptables-nft iptables-nft-save ip6tables-nft ip6tables-nft-save \
		iptables-nft-restore ip6tables-nft-restore; do
		ln -s xtables-nft-multi "$base/usr/sbin/$bin"
	done
	for bin in iptables-legacy iptables-legacy-save iptables-legacy-restore ip6tables-legacy ip6tables-legacy-save ip6tables-legacy-restore; do
		ln -s xtables-legacy-multi "$base/usr/sbin/$bin"
	done
	# iptables loads its matches and targets as plugins.
	local xt=/usr/lib/x86_64-linux-gnu/xtables
	mkdir -p "$base$xt"
	cp -a "$xt"/. "$base$xt/"
	for lib in $(ldd "$xt"/*.so 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $1 !~ /:$/ {print $1}' | sort -u); do
		[ -e "$base$lib" ] || { mkdir -p "$base$(dirname "$lib")"; cp -L "$lib" "$base$lib"; }
	done
	echo 'root:x:0:0:root:/root:/bin/sh' >"$base/etc/passwd"
	echo 'root:x:0:' >"$base/etc/group"
	(cd "$base" && find . | cpio -o -H newc --quiet) >"$work/base.cpio"
}

# build_base_foreign ARCH: the same for a guest of another architecture:
# Debian's packages of the tools and their libraries (fetch-userland.sh),
# the names Debian's alternatives would give iptables, and the tests of
# that architecture. Its dynamic loader finds the libraries through
# LD_LIBRARY_PATH, set on the kernel command line (no ld.so.cache).
build_base_foreign() {
	local arch=$1 base=$work/base.$1 userland bin
	[ -e "$work/base.$arch.cpio" ] && return
	userland=$("$here/fetch-userland.sh" "$vcache" "$arch")
	mkdir -p "$base"
	cp -a "$userland"/. "$base/"
	rm -f "$base/.done"
	mkdir -p "$base"/{sbin,usr/sbin,etc,proc,sys,dev,tmp,run,tests}
	ln -sf busybox "$base/bin/sh"
	ln -sf ../bin/busybox "$base/sbin/modprobe"
	cp "$here/init" "$base/init"
	cp "$work/tests.$arch"/* "$base/tests/"
	for bin in iptables ip6tables iptables-restore ip6tables-restore iptables-save ip6tables-save; do
		ln -sf xtables-nft-multi "$base/usr/sbin/$bin"
	done
	echo 'root:x:0:0:root:/root:/bin/sh' >"$base/etc/passwd"
	echo 'root:x:0:' >"$base/etc/group"
	(cd "$base" && find . | cpio -o -H newc --quiet) >"$work/base.$arch.cpio"
}

# The modules the suites need (and their dependencies), uncompressed, with
# modules.dep made for them.
modules="veth sch_ingress cls_bpf act_bpf nf_tables nft_compat nft_chain_nat nft_ct nfnetlink
ip_tables ip6_tables iptable_nat iptable_mangle iptable_raw iptable_filter ip6table_nat ip6table_mangle
ip6table_raw ip6table_filter nf_nat nf_conntrack xt_owner xt_set xt_mark xt_connmark xt_CT xt_REDIRECT
xt_MASQUERADE xt_nat xt_tcpudp xt_comment ip_set ip_set_hash_ip ip_set_hash_net nf_defrag_ipv4 nf_defrag_ipv6
nf_reject_ipv4 nf_reject_ipv6 xt_TPROXY nf_tproxy_ipv4 nf_tproxy_ipv6 xt_socket nf_socket_ipv4 nf_socket_ipv6
nf_conntrack_netlink nft_nat nft_redir nft_masq inet_diag tcp_diag"

build_modules() {
	local kdir=$1 rel=$2 out=$3 extra=${4:-} m f
	local mroot=$work/mods.$rel
	rm -rf "$mroot"
	mkdir -p "$mroot/lib/modules/$rel" "$mroot/etc"
	cp "$kdir/lib/modules/$rel"/modules.{order,builtin}* "$mroot/lib/modules/$rel/" 2>/dev/null || true
	# The package leaves modules.dep to its postinst; make it once.
	[ -e "$kdir/lib/modules/$rel/modules.dep" ] || depmod -b "$kdir" "$rel"
	# Every nftables expression and xtables extension too: iptables-nft
	# asks for them by alias, which busybox's modprobe does not resolve.
	local all
	all="$modules $extra $(find "$kdir/lib/modules/$rel/kernel/net" -name 'nft_*.ko*' -o -name 'xt_*.ko*' |
		sed -E 's|.*/||; s|\.ko(\.[a-z]+)?$||' | sort)"
	for m in $all; do
		# A module this kernel lacks (or has built in) is reported, not
		# fatal: the guest's init names the ones that did not load.
		modprobe -d "$kdir" -S "$rel" --show-depends "$m" 2>/dev/null | awk '$1 == "insmod" {print $2}' ||
			log "$rel: no module $m"
	done | sort -u | while read -r f; do
		local dst=$mroot${f#"$kdir"}
		mkdir -p "$(dirname "$dst")"
		case $f in
		*.xz) xz -dc "$f" >"${dst%.xz}" ;;
		*.zst) zstd -qdc "$f" >"${dst%.zst}" ;;
		*) cp "$f" "$dst" ;;
		esac
	done
	depmod -b "$mroot" "$rel"
	echo "$all" | tr ' ' '\n' | grep . >"$mroot/etc/vmtest-modules"
	(cd "$mroot" && find . | cpio -o -H newc --quiet) >"$out"
}

run_vm() {
	local k=$1 arch series kdir rel
	arch=$(karch "$k") series=$(kseries "$k")
	kdir=$("$here/fetch-kernel.sh" "$vcache" "$series" "$arch")
	rel=$(basename "$(ls -d "$kdir"/lib/modules/*)")
	local base=$work/base.cpio
	[ "$arch" = amd64 ] || base=$work/base.$arch.cpio
	# arm64: the virtio console the results go to (built in on 6.12,
	# modules on 6.1).
	build_modules "$kdir" "$rel" "$work/mods.$rel.cpio" "$([ "$arch" = amd64 ] || echo virtio_pci virtio_console)"
	cat "$base" "$work/mods.$rel.cpio" | gzip -1 >"$work/initrd.$rel.gz"
	log "$rel: booting (qemu tcg, timeout ${VMTEST_TIMEOUT}s)"
	local console=$work/console.$rel results=$work/results.$rel
	: >"$results"
	local bins=""
	[ ! -d "$work/bins" ] || bins=/bins
	local env="CI=${CI:-} VMTEST_KERNEL=$k VMTEST_RUN=${VMTEST_RUN:-} VMTEST_SKIP=$VMTEST_GUEST_SKIP AMBIENT_EBPF_TEST_BINS=$bins AMBIENT_EBPF_GUEST=1"
	local qemu=(qemu-system-x86_64 -accel tcg,thread=multi -cpu max)
	local io=(-serial "file:$console" -serial "file:$results")
	local console_dev=ttyS0
	if [ "$arch" = arm64 ]; then
		qemu=(qemu-system-aarch64 -M virt -accel tcg,thread=multi -cpu max)
		io=(-serial "file:$console" -device virtio-serial-pci -chardev "file,id=results,path=$results" -device virtconsole,chardev=results)
		console_dev=ttyAMA0
		env="$env VMTEST_OUT=/dev/hvc0 LD_LIBRARY_PATH=/lib/aarch64-linux-gnu:/usr/lib/aarch64-linux-gnu"
	fi
	timeout --foreground -k 10 "$VMTEST_TIMEOUT" "${qemu[@]}" -smp "$VMTEST_SMP" -m "$VMTEST_MEM" \
		-nodefaults -no-reboot -display none \
		-kernel "$kdir/boot/vmlinuz-$rel" -initrd "$work/initrd.$rel.gz" \
		-append "console=$console_dev panic=-1 quiet loglevel=4 $env" \
		"${io[@]}" </dev/null || log "$rel: qemu exited with $?"
	if ! summarize "$rel" <"$results"; then
		# A panic's cause is the first oops, which the last lines of a
		# cascade of them do not show.
		if grep -qE 'BUG:|Oops|WARNING:|Kernel panic' "$console"; then
			log "$rel: the guest kernel's first report:"
			grep -m1 -A50 -E 'BUG:|Oops|WARNING:|Kernel panic' "$console" >&2
		fi
		log "$rel: last console lines:"
		tail -n 30 "$console" >&2
		return 1
	fi
}

[ $# -gt 0 ] || set -- host 5.10 6.1 6.12
for k in "$@"; do
	case $k in
	host | 5.10 | 6.1 | 6.12 | arm64-6.1 | arm64-6.12) ;;
	*) log "unknown kernel $k (want host, 5.10, 6.1, 6.12, arm64-6.1 or arm64-6.12)"; exit 2 ;;
	esac
done
run_kernels="$*"
build_tests
case " $* " in *" arm64-"*) build_tests arm64 ;; esac
for k in "$@"; do
	# Downloads one at a time: kernels of one suite share an apt directory.
	[ "$k" = host ] && continue
	if [ "$(karch "$k")" = amd64 ]; then
		build_base
	else
		build_base_foreign "$(karch "$k")"
	fi
	"$here/fetch-kernel.sh" "$vcache" "$(kseries "$k")" "$(karch "$k")" >/dev/null
done
# Kernels run VMTEST_JOBS at a time (default 1: two emulated guests on a
# two-core machine slow each other into timeouts); each one's report is
# printed whole, in the order given.
jobs=${VMTEST_JOBS:-1}
running=0
for k in "$@"; do
	if [ "$k" = host ]; then
		run_host >"$work/log.$k" 2>&1 &
	else
		run_vm "$k" >"$work/log.$k" 2>&1 &
	fi
	echo $! >"$work/pid.$k"
	running=$((running + 1))
	if [ "$running" -ge "$jobs" ]; then
		wait -n || true
		running=$((running - 1))
	fi
done
failed=()
for k in "$@"; do
	wait "$(cat "$work/pid.$k")" || failed+=("$k")
	cat "$work/log.$k"
done
if [ ${#failed[@]} -gt 0 ]; then
	log "failed on: ${failed[*]}"
	exit 1
fi
log "all kernels passed: $*"
