#!/usr/bin/env bash
# Copyright ambient-ebpf authors
# SPDX-License-Identifier: Apache-2.0
#
# fetch-userland.sh CACHE ARCH: downloads Debian 12's packages of the tools
# the kernel suites call inside a guest of another architecture than the
# host's (busybox, ip, iptables of both backends, nft, ipset, nsenter) and
# of their shared libraries, extracts them into one directory under CACHE
# without installing anything, and prints that directory. An amd64 guest
# gets the host's own tools instead (vmtest.sh's build_base). apt runs on a
# configuration of its own under CACHE, as in fetch-kernel.sh.
set -euo pipefail
cache=$1 arch=$2
# The tools, and every library they load (ldd's closure, named by package
# as Debian 12 ships them; a missing one fails the guest's first call).
packages="busybox-static iproute2 iptables nftables ipset util-linux
libc6 libgcc-s1 libaudit1 libblkid1 libbpf1 libbsd0 libcap-ng0 libcap2 libcom-err2 libcrypt1 libdb5.3
libedit2 libelf1 libgcrypt20 libgmp10 libgpg-error0 libgssapi-krb5-2 libip4tc2 libip6tc2 libipset13
libjansson4 libk5crypto3 libkeyutils1 libkrb5-3 libkrb5support0 liblz4-1 liblzma5 libmd0 libmnl0
libmount1 libnetfilter-conntrack3 libnfnetlink0 libnftables1 libnftnl11 libpcre2-8-0 libreadline8
libselinux1 libsmartcols1 libssl3 libsystemd0 libtinfo6 libtirpc-common libtirpc3 libudev1 libuuid1
libxtables12 libzstd1 zlib1g"
apt_dir=$cache/apt/bookworm-$arch-userland
mkdir -p "$apt_dir/state/lists/partial" "$apt_dir/cache/archives/partial"
cat >"$apt_dir/sources.list" <<EOF
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-updates main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bookworm-security main
EOF
apt_opts=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o "Dir::Etc::sourceparts=-"
	-o "Dir::State=$apt_dir/state" -o "Dir::State::status=/dev/null" -o "Dir::Cache=$apt_dir/cache"
	-o "APT::Get::List-Cleanup=0" -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root"
	-o "APT::Architecture=$arch" -o "APT::Architectures::=$arch")
if [ -z "$(find "$apt_dir/state/lists" -maxdepth 1 -name '*Packages*' -mtime -1 2>/dev/null)" ]; then
	apt-get "${apt_opts[@]}" -qq update >&2
fi
# The directory is named by the candidate versions: a security update
# makes a new one.
versions=$(for p in $packages; do
	v=$(apt-cache "${apt_opts[@]}" policy "$p" | awk '/Candidate:/ {print $2}')
	[ -n "$v" ] && [ "$v" != "(none)" ] || { echo "fetch-userland: no $p for $arch in bookworm" >&2; exit 1; }
	echo "$p=$v"
done)
dest=$cache/userland/$arch-$(echo "$versions" | sha256sum | cut -c1-12)
if [ ! -e "$dest/.done" ]; then
	debs=$apt_dir/debs
	rm -rf "$debs" "$dest"
	mkdir -p "$debs" "$dest"
	# shellcheck disable=SC2086 # one word per package=version
	(cd "$debs" && apt-get "${apt_opts[@]}" -qq download $versions >&2)
	for d in "$debs"/*.deb; do
		dpkg-deb -x "$d" "$dest"
	done
	rm -rf "$dest/usr/share" "$debs"
	touch "$dest/.done"
fi
echo "$dest"
