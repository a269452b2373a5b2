#!/usr/bin/env bash
# Copyright ambient-ebpf authors
# SPDX-License-Identifier: Apache-2.0
#
# version.sh: the version the build stamps into every binary (Makefile,
# Dockerfile's VERSION argument, the tests' builds). A release commit is its
# version ("v0.1.0"); a later commit is the last release it contains, the
# commits since and its short hash ("v0.1.0-2-gfed2263"), "-dirty" with
# local changes: git describe's format, taken from hack/releases rather
# than from tags, which may be missing. Without git: "(devel)".
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
git rev-parse --git-dir >/dev/null 2>&1 || { echo "(devel)"; exit 0; }
head=$(git rev-parse HEAD)
best="" best_n=""
while read -r v sha; do
	case $v in '' | '#'*) continue ;; esac
	git merge-base --is-ancestor "$sha" "$head" 2>/dev/null || continue
	n=$(git rev-list --count "$sha..$head")
	if [ -z "$best_n" ] || [ "$n" -lt "$best_n" ]; then best=$v best_n=$n; fi
done <hack/releases
dirty=""
git diff --quiet HEAD -- 2>/dev/null || dirty="-dirty"
if [ -z "$best" ]; then
	echo "v0.0.0-g$(git rev-parse --short=7 HEAD)$dirty"
elif [ "$best_n" -eq 0 ]; then
	echo "$best$dirty"
else
	echo "$best-$best_n-g$(git rev-parse --short=7 HEAD)$dirty"
fi
