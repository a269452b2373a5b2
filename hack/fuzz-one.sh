#!/usr/bin/env bash
# Copyright ambient-ebpf authors
# SPDX-License-Identifier: Apache-2.0
#
# fuzz-one.sh DIR NAME FUZZTIME: runs one fuzzer (make fuzz calls it for
# each). Go's fuzz coordinator up to at least go1.26 can fail a run at the
# -fuzztime boundary with a bare "context deadline exceeded" and no failing
# input (golang/go#75804, fixed in go1.27): such a run, and only such a run
# (no new file in DIR/testdata/fuzz/NAME), is tried once more. A failing
# input always fails.
set -uo pipefail
dir=$1 name=$2 fuzztime=$3
GO=${GO:-go}
corpus=$dir/testdata/fuzz/$name
count() { find "$corpus" -type f 2>/dev/null | wc -l; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for try in 1 2; do
	before=$(count)
	if $GO test -run '^$' -fuzz "^$name\$" -fuzztime "$fuzztime" "$dir" 2>&1 | tee "$out"; then
		exit 0
	fi
	if [ "$try" = 1 ] && [ "$(count)" = "$before" ] && grep -q '^    context deadline exceeded$' "$out"; then
		echo "fuzz: $name: the fuzz coordinator's deadline race (golang/go#75804), no failing input: trying once more"
		continue
	fi
	exit 1
done
