#!/usr/bin/env bash
# Copyright ambient-ebpf authors
# SPDX-License-Identifier: Apache-2.0
#
# fetch-kernel.sh CACHE SERIES [ARCH]: downloads Debian's cloud kernel of
# SERIES (5.10, 6.1 or 6.12) for ARCH (amd64, the default, or arm64) into
# CACHE without installing it, and prints the directory it was extracted to
# (boot/vmlinuz-*, lib/modules/*). apt runs on a configuration of its own
# under CACHE: the machine's apt sources and state are never read or
# written.
set -euo pipefail
cache=$1 series=$2 arch=${3:-amd64}
case $arch in
amd64 | arm64) ;;
*) echo "fetch-kernel: unknown architecture $arch (want amd64 or arm64)" >&2; exit 2 ;;
esac
# amd64's 6.1 image is the signed package; arm64's 6.1 and both 6.12
# ones may be published unsigned only.
unsigned='(-unsigned)?'
[ "$arch" != amd64 ] || unsigned=''
case $series in
5.10) suite="bullseye-security" uri="http://deb.debian.org/debian-security" pattern="^linux-image-5\\.10\\.0-[0-9]+-cloud-$arch\$" ;;
6.1) suite="bookworm-security" uri="http://deb.debian.org/debian-security" pattern="^linux-image-6\\.1\\.0-[0-9]+-cloud-$arch$unsigned\$" ;;
6.12) suite="bookworm-security" uri="http://deb.debian.org/debian-security" pattern="^linux-image-6\\.12\\.[0-9]+\\+deb12-cloud-$arch(-unsigned)?\$" ;;
*) echo "fetch-kernel: unknown series $series (want 5.10, 6.1 or 6.12)" >&2; exit 2 ;;
esac
apt_dir=$cache/apt/$suite
[ "$arch" = amd64 ] || apt_dir=$cache/apt/$suite-$arch
mkdir -p "$apt_dir/state/lists/partial" "$apt_dir/cache/archives/partial" "$cache/debs" "$cache/kernels"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri $suite main" >"$apt_dir/sources.list"
apt_opts=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o "Dir::Etc::sourceparts=-"
	-o "Dir::State=$apt_dir/state" -o "Dir::State::status=/dev/null" -o "Dir::Cache=$apt_dir/cache"
	-o "APT::Get::List-Cleanup=0" -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root"
	-o "APT::Architecture=$arch" -o "APT::Architectures::=$arch")
# One index refresh a day is plenty; kernels come and go with security updates.
if [ -z "$(find "$apt_dir/state/lists" -maxdepth 1 -name '*Packages*' -mtime -1 2>/dev/null)" ]; then
	apt-get "${apt_opts[@]}" -qq update >&2
fi
pkg=$(apt-cache "${apt_opts[@]}" search --names-only "$pattern" | awk '{print $1}' | sort -V | tail -1)
[ -n "$pkg" ] || { echo "fetch-kernel: no package matches $pattern in $suite" >&2; exit 1; }
dest=$cache/kernels/$pkg
if [ ! -e "$dest/.done" ]; then
	(cd "$cache/debs" && apt-get "${apt_opts[@]}" -qq download "$pkg" >&2)
	rm -rf "$dest"
	dpkg-deb -x "$(ls -t "$cache/debs/${pkg}"_*.deb | head -1)" "$dest"
	touch "$dest/.done"
fi
echo "$dest"
