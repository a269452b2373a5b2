# ambient-ebpf build, test and demo entry points. `make help` lists them.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

GO        ?= go
# bpf2go reads these from the environment; clang is pinned so the committed
# objects are reproducible (`make check-generated`), and the debug info names
# no directory, so they are the same from any checkout's path.
BPF2GO_CC    ?= clang-19
BPF2GO_STRIP ?= llvm-strip-19
BPF2GO_CFLAGS ?= -O2 -g -Wall -Werror -fdebug-compilation-dir=.
export BPF2GO_CC BPF2GO_STRIP BPF2GO_CFLAGS

# Packages whose go:generate lines run bpf2go.
GEN_PKGS  := ./pkg/dataplane/...
APT_PKGS  := clang-19 llvm-19 libbpf-dev bpftool iproute2 iptables ipset nftables protobuf-compiler containerd runc \
	qemu-system-x86 qemu-system-arm busybox-static cpio kmod xz-utils
# Kernels `make test-kernels` runs the kernel suites on: the host's, then
# Debian's cloud kernels under qemu (see hack/vmtest/vmtest.sh), arm64's
# 6.12 included (qemu-system-aarch64, software emulation of another
# architecture). One boot per kernel, one at a time.
VMTEST_KERNELS ?= host 5.10 6.1 6.12 arm64-6.12
# Emulated guests at once. One guest keeps about 1.2 of the two cores
# busy, but two at once (two vCPUs each) ran 46 min against about 54 one
# after another, and the upgrade suite's killed-migration test lost a
# connection on the slowed 5.10 guest: so one.
VMTEST_JOBS ?= 1
# On arm64, CI runs the conformance suite (every row, both backends, v4
# and v6: about 6 min emulated) and pkg/dataplane's refusal to share a hook
# with a program attached exclusively (issue 35: on every kernel);
# `make test-kernels-arm64` runs the rest too (pkg/features, all of
# pkg/dataplane) on 6.1 and 6.12.
VMTEST_ARM64_PKGS ?= ./test/conformance ./pkg/dataplane:^TestNewNamesAProgramThatHoldsAHookAlone$$
# The suites of the real agent binary run under emulation too (make test
# runs them on the host), in the same boot as the kernel suites
# (KERNELS@PKG: only on those kernels). On 5.10, the kernel furthest from
# the host's and the one whose inbound capture differs (tc on the pod's
# interface): the upgrade, downgrade and layout-migration suites
# (test/agente2e, with prebuilt agent binaries). On 5.10, 6.1 and 6.12
# (every kernel of the matrix), the takeover and hand-back from istio-cni
# (test/takeover). The upgrade suites on 6.1 and 6.12 would take the
# kernel suites past CI's time.
VMTEST_AGENT_PKGS := 5.10@./test/agente2e:^(TestUpgradeFromTheLastRelease|TestDowngradeToTheLastRelease|TestMigrateToTheNextLayoutAndBack|TestAgentKilledDuringAMigrationFinishesIt)$$ \
	5.10,6.1,6.12@./test/takeover:^TestTakeoverAndHandBack$$
VMTEST_PKGS ?= ./pkg/features ./pkg/dataplane ./test/conformance $(VMTEST_AGENT_PKGS)
CACHE     := $(CURDIR)/.cache
GOTESTFLAGS ?= -race -count=1 -timeout 40m
# Protobuf code generators, pinned; installed into $(CACHE)/bin by `make proto-tools`.
PROTOC_GEN_GO_VERSION      := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.2
PROTO_FILES := $(wildcard pkg/api/*/*.proto)
# Reference CNI plugins for the chain test, built from source into the cache.
CNI_PLUGINS_VERSION := v1.10.0
CNI_PLUGINS_DIR     := $(CACHE)/cni-plugins/$(CNI_PLUGINS_VERSION)
# kube-apiserver and etcd for the real-API-server tests (test/kubeapi), built
# once per version from the wrapper modules under hack/tools/.
KUBE_VERSION := v1.37.2
ETCD_VERSION := v3.7.3
KUBE_BINS    := $(CACHE)/kube/$(KUBE_VERSION)
KUBE_LDFLAGS := -X k8s.io/component-base/version.gitVersion=$(KUBE_VERSION) -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37
export AMBIENT_EBPF_KUBE_BINS := $(KUBE_BINS)
# The real istio-cni (issue 32): its node agent install-cni and its chained
# plugin istio-cni, built once per version of istio.io/istio in go.mod from
# the wrapper module hack/tools/istio-cni, for the differential tests and the
# benchmark's enrolment figures only (nothing shipped links Istio's cni
# packages). The wrapper must require the same version as go.mod;
# test/istiocnireal refuses binaries of another.
ISTIO_VERSION  := $(shell awk '$$1 == "istio.io/istio" { print $$2 }' go.mod)
ISTIO_WRAPPER_VERSION := $(shell awk '$$1 == "istio.io/istio" { print $$2 }' hack/tools/istio-cni/go.mod)
ISTIO_CNI_BINS := $(CACHE)/istio-cni/$(ISTIO_VERSION)
ISTIO_LDFLAGS  := -X istio.io/istio/pkg/version.buildVersion=$(ISTIO_VERSION) \
	-X istio.io/istio/pkg/version.buildGitRevision=$(lastword $(subst -, ,$(ISTIO_VERSION))) -X istio.io/istio/pkg/version.buildStatus=Clean
export AMBIENT_EBPF_ISTIO_CNI_BINS := $(ISTIO_CNI_BINS)
# The version stamped into every binary (hack/version.sh: the last release of
# hack/releases and the commits since, git describe style) and its commit.
VERSION  ?= $(shell hack/version.sh)
REVISION ?= $(shell git rev-parse HEAD 2>/dev/null)
BUILDINFO := github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo
VERSION_LDFLAGS := -X $(BUILDINFO).stampedVersion=$(VERSION) -X $(BUILDINFO).stampedRevision=$(REVISION)
# Under CI=true a skipped test fails the run.
TESTREPORT_FLAGS := $(if $(filter true,$(CI)),-fail-on-skip,)

.PHONY: help
help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

.PHONY: deps
deps: ## install the toolchain (apt) and download Go modules; quick when done already
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "deps: installing$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	$(GO) mod download

# The repository's git hooks (hack/git-hooks: commit-msg checks the
# conventions of CONTRIBUTING.md). Installed once into the clone; a tree
# without .git (a tarball, the image's context) has nothing to install.
.PHONY: hooks
hooks: ## install the git hooks of hack/git-hooks into this clone (core.hooksPath)
	@git rev-parse --git-dir >/dev/null 2>&1 || exit 0; \
	[ "$$(git config core.hooksPath)" = hack/git-hooks ] || git config core.hooksPath hack/git-hooks || \
		echo "hooks: could not set core.hooksPath (not this clone's owner?); commits go unchecked"

.PHONY: generate
generate: ## run bpf2go (clang-19) for every BPF object; outputs are committed
	$(GO) generate $(GEN_PKGS)

.PHONY: proto-tools
proto-tools: ## install the pinned protoc-gen-go and protoc-gen-go-grpc into .cache/bin
	@test -x $(CACHE)/bin/protoc-gen-go && test -x $(CACHE)/bin/protoc-gen-go-grpc && \
		$(CACHE)/bin/protoc-gen-go --version | grep -q '$(PROTOC_GEN_GO_VERSION)$$' && \
		$(CACHE)/bin/protoc-gen-go-grpc --version | grep -q '$(PROTOC_GEN_GO_GRPC_VERSION:v%=%)$$' || { \
		GOBIN=$(CACHE)/bin GOFLAGS=-mod=mod $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION) && \
		GOBIN=$(CACHE)/bin GOFLAGS=-mod=mod $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION); }

.PHONY: proto
proto: proto-tools ## generate Go and gRPC code from pkg/api/**/*.proto; outputs are committed
	PATH="$(CACHE)/bin:$$PATH" protoc -I pkg/api --go_out=pkg/api --go_opt=paths=source_relative \
		--go-grpc_out=pkg/api --go-grpc_opt=paths=source_relative $(PROTO_FILES:pkg/api/%=%)

.PHONY: check-generated
check-generated: proto-tools ## regenerate BPF objects and protobuf code in a scratch copy and fail on any difference
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} cp --parents {} "$$tmp"/ 2>/dev/null || true; \
	cd "$$tmp" && { [ ! -d pkg/dataplane ] || $(GO) generate $(GEN_PKGS); } && $(MAKE) --no-print-directory -s proto CACHE=$(CACHE) >/dev/null && \
	if ! git -C "$(CURDIR)" diff --no-index --stat -- "$(CURDIR)/pkg" "$$tmp/pkg" >/dev/null 2>&1; then \
		git -C "$(CURDIR)" diff --no-index --stat -- "$(CURDIR)/pkg" "$$tmp/pkg" || true; \
		echo "check-generated: generated outputs are stale; run 'make generate proto' and commit"; exit 1; \
	fi; echo "check-generated: bpf2go and protobuf outputs are up to date"

.PHONY: cni-plugins
cni-plugins: ## build bridge, ptp, host-local and loopback $(CNI_PLUGINS_VERSION) for the CNI chain test
	@test -x $(CNI_PLUGINS_DIR)/bridge && test -x $(CNI_PLUGINS_DIR)/ptp && test -x $(CNI_PLUGINS_DIR)/host-local && test -x $(CNI_PLUGINS_DIR)/loopback || \
	GOBIN=$(CNI_PLUGINS_DIR) GOFLAGS=-mod=mod CGO_ENABLED=0 $(GO) install \
		github.com/containernetworking/plugins/plugins/main/bridge@$(CNI_PLUGINS_VERSION) \
		github.com/containernetworking/plugins/plugins/main/ptp@$(CNI_PLUGINS_VERSION) \
		github.com/containernetworking/plugins/plugins/ipam/host-local@$(CNI_PLUGINS_VERSION) \
		github.com/containernetworking/plugins/plugins/main/loopback@$(CNI_PLUGINS_VERSION)

.PHONY: build
build: hooks ## build all binaries into bin/
	@mkdir -p bin
	$(GO) build -trimpath -ldflags '$(VERSION_LDFLAGS)' -o bin/ ./cmd/...

# The image's other architecture: static binaries, as the Dockerfile's go
# build makes them, into bin/linux_arm64/ (the BPF objects are bpf2go's
# -target bpfel, one for every little-endian architecture; docs/KERNELS.md,
# "Architectures"). deploy's TestCommandsBuildForEveryImageArch builds them
# in make test.
.PHONY: build-arm64
build-arm64: hooks ## cross-compile all binaries for linux/arm64 (static) into bin/linux_arm64/
	@mkdir -p bin/linux_arm64
	CGO_ENABLED=0 GOOS=linux GOARCH=arm64 $(GO) build -trimpath -ldflags '$(VERSION_LDFLAGS)' -o bin/linux_arm64/ ./cmd/...

.PHONY: vet
vet: ## go vet and gofmt
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt needed"; exit 1; }
	$(GO) vet ./...
	$(GO) vet -tags bench ./test/bench
	$(GO) vet -tags bench,istiocnireal ./test/bench
	$(GO) vet -tags istiocnireal ./test/differential

.PHONY: kube-bins
kube-bins: $(KUBE_BINS)/kube-apiserver $(KUBE_BINS)/etcd $(KUBE_BINS)/kubelet ## build kube-apiserver, etcd and kubelet into .cache/kube/<version> once (cold: ~15 min, kubelet ~5 min more)

# Each binary is written under a temporary name and renamed, so an interrupted
# build never leaves a file that make would take as up to date.
$(KUBE_BINS)/kube-apiserver: hack/tools/kube-apiserver/go.mod hack/tools/kube-apiserver/go.sum hack/tools/kube-apiserver/main.go
	@mkdir -p $(KUBE_BINS)
	cd hack/tools/kube-apiserver && nice $(GO) build -trimpath -ldflags '$(KUBE_LDFLAGS)' -o $@.tmp . && mv $@.tmp $@

# kubelet after kube-apiserver: it reuses most of that build's cache.
$(KUBE_BINS)/kubelet: hack/tools/kubelet/go.mod hack/tools/kubelet/go.sum hack/tools/kubelet/main.go | $(KUBE_BINS)/kube-apiserver
	@mkdir -p $(KUBE_BINS)
	cd hack/tools/kubelet && nice $(GO) build -trimpath -ldflags '$(KUBE_LDFLAGS)' -o $@.tmp . && mv $@.tmp $@

$(KUBE_BINS)/etcd: hack/tools/etcd/go.mod hack/tools/etcd/go.sum hack/tools/etcd/main.go
	@mkdir -p $(KUBE_BINS)
	cd hack/tools/etcd && nice $(GO) build -trimpath -o $@.tmp . && mv $@.tmp $@

# Both from one go build: the second shares the first's packages. The
# wrapper's version is checked against go.mod's first, naming both.
.PHONY: istio-cni-bins
istio-cni-bins: $(ISTIO_CNI_BINS)/install-cni $(ISTIO_CNI_BINS)/istio-cni ## build the real istio-cni (install-cni, istio-cni) of go.mod's istio.io/istio into .cache/istio-cni/<version> once

$(ISTIO_CNI_BINS)/install-cni $(ISTIO_CNI_BINS)/istio-cni &: hack/tools/istio-cni/go.mod hack/tools/istio-cni/go.sum
	@[ "$(ISTIO_WRAPPER_VERSION)" = "$(ISTIO_VERSION)" ] || { echo "istio-cni-bins: hack/tools/istio-cni/go.mod requires istio.io/istio $(ISTIO_WRAPPER_VERSION) but go.mod has $(ISTIO_VERSION); update the wrapper (go get istio.io/istio@$(ISTIO_VERSION) && go mod tidy there)"; exit 1; }
	@mkdir -p $(ISTIO_CNI_BINS)
	@tmp=$$(mktemp -d $(ISTIO_CNI_BINS)/.build.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; \
	cd hack/tools/istio-cni && nice $(GO) build -trimpath -ldflags '$(ISTIO_LDFLAGS)' -o "$$tmp"/ \
		istio.io/istio/cni/cmd/install-cni istio.io/istio/cni/cmd/istio-cni && \
	mv "$$tmp"/install-cni $(ISTIO_CNI_BINS)/install-cni && mv "$$tmp"/istio-cni $(ISTIO_CNI_BINS)/istio-cni

# The suites make test-unit leaves out: they build binaries and images,
# start API servers, nodes and the demo, and most of them need root.
E2E_PKGS := ./demo ./test/agente2e ./test/cnichain ./test/conformance ./test/kubee2e ./test/node ./test/soak ./test/takeover
UNIT_GOTESTFLAGS ?= -race -count=1 -short -timeout 5m

# -short: tests that need root, the kernel or kube-apiserver skip
# (testenv.RequireRoot, kubeapi.ErrShort), also as root, and CI is unset so
# those skips are not failures. GOPROXY=off: nothing is downloaded; the
# modules come from the module cache (make deps, or any earlier build).
# /usr/sbin joins PATH: a user's PATH on Debian lacks it, and a few tests
# look for bpftool, iptables and nft before they skip without root.
.PHONY: test-unit
test-unit: hooks ## the fast loop: every test that needs no root, kernel or download (-short, the e2e suites left out); under 2 min warm
	CI= GOPROXY=off PATH="$$PATH:/usr/sbin:/sbin" $(GO) test $(UNIT_GOTESTFLAGS) \
		$$($(GO) list ./... | grep -vE '/($(subst $(eval) ,|,$(E2E_PKGS:./%=%)))$$')

# One suite, or one test of it: make test-one PKG=./pkg/zds RUN='^TestZ9'.
# As root for the kernel suites; nothing is installed or built first.
PKG ?=
RUN ?= .
.PHONY: test-one
test-one: hooks ## run one package's tests matching RUN: make test-one PKG=./pkg/zds RUN=TestZ9 (verbose, race on)
	@test -n "$(PKG)" || { echo "test-one: name the package: make test-one PKG=./pkg/zds RUN=TestZ9"; exit 2; }
	CNI_PLUGINS_DIR=$(CNI_PLUGINS_DIR) $(GO) test $(GOTESTFLAGS) -v -run '$(RUN)' $(PKG)

# What make test builds and checks before its first test: .ci/run makes it
# first, so that an emulated kernel leg can run beside the tests (which
# leave most of a core idle) rather than beside the builds (which take
# both).
.PHONY: test-deps
test-deps: hooks deps vet cni-plugins kube-bins istio-cni-bins ## build and check what make test needs before its first test

.PHONY: test
test: test-deps ## run every test, kernel suites included (as root), then the fuzzers; the README's test command
	$(GO) build -o $(CACHE)/bin/testreport ./hack/testreport
	CNI_PLUGINS_DIR=$(CNI_PLUGINS_DIR) $(GO) test -tags istiocnireal $(GOTESTFLAGS) -json ./... 2>&1 | $(CACHE)/bin/testreport $(TESTREPORT_FLAGS)
	$(MAKE) --no-print-directory fuzz

# Every `func FuzzXxx` in a _test.go file is a fuzzer `make fuzz` runs, so
# new ones need no registration. Their seeds (f.Add, testdata/fuzz/) also run
# as plain tests in `go test`. A failing input is written to the package's
# testdata/fuzz/FuzzXxx/: commit it with the fix, as a regression seed.
FUZZTIME ?= 4s

.PHONY: fuzz
fuzz: ## run each fuzzer of the repo for FUZZTIME (default 4s), one after another; fails if any fails
	@failed=""; \
	for file in $$(grep -rlE --include='*_test.go' --exclude-dir=.cache --exclude-dir=.git '^func Fuzz[A-Za-z0-9_]*\(' . | sort); do \
		dir=./$$(dirname "$${file#./}"); \
		for name in $$(sed -nE 's/^func (Fuzz[A-Za-z0-9_]*)\(.*/\1/p' "$$file"); do \
			echo "fuzz: $$name ($$dir) for $(FUZZTIME)"; \
			GO=$(GO) hack/fuzz-one.sh "$$dir" "$$name" $(FUZZTIME) || failed="$$failed $$dir:$$name"; \
		done; \
	done; \
	if [ -n "$$failed" ]; then echo "fuzz: failed:$$failed"; exit 1; fi; echo "fuzz: every fuzzer passed"

IMAGE ?= ghcr.io/ambient-ebpf/ambient-ebpf:dev

.PHONY: image
image: ## build the container image and its -takeover flavor (needs docker; deploy/dockerfile_test.go checks the Dockerfile without it)
	docker build --build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) -t $(IMAGE) .
	docker build --build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) --target takeover -t $(IMAGE)-takeover .

.PHONY: demo
demo: hooks deps build cni-plugins ## run a self-contained demo node (root): CNI chain, agent, ztunnel stand-in, real traffic
	$(GO) run ./demo --bin bin --cni-plugins $(CNI_PLUGINS_DIR) --pods demo/pods.yaml

# The suite against the real istio-cni (issue 32) alone: test/differential,
# built with the istiocnireal tag, and its harness test/istiocnireal. make
# test runs them too (with the tag); under CI=true a skip fails it as there.
.PHONY: test-istio-cni
test-istio-cni: hooks istio-cni-bins kube-bins cni-plugins ## run the differential suite against the real istio-cni (root; builds it first)
	$(GO) build -o $(CACHE)/bin/testreport ./hack/testreport
	CNI_PLUGINS_DIR=$(CNI_PLUGINS_DIR) $(GO) test -tags istiocnireal $(GOTESTFLAGS) -json ./test/istiocnireal ./test/differential 2>&1 | \
		$(CACHE)/bin/testreport $(TESTREPORT_FLAGS)

# Knobs: BENCH_REPS, BENCH_DURATION, BENCH_CONC, BENCH_RTTS, BENCH_ENROLL_PODS,
# BENCH_SCALE_PODS, BENCH_PARTS (see test/bench/bench_test.go). bench/results.json is
# committed with the docs/BENCHMARKS.md that quotes it; it names its commit.
# The enrolment figures include the real istio-cni (enroll_cni_istiocni_*,
# the istiocnireal tag): its binaries, the API server's and the primary
# network's plugins are built first.
.PHONY: test-takeover-crash
test-takeover-crash: deps ## the takeover's crash tests alone (test/takeover; make test runs them too)
	$(GO) test $(GOTESTFLAGS) -run '^TestTakeoverKilledMidwayFinishesOnRestart$$' -v ./test/takeover

.PHONY: bench
bench: deps istio-cni-bins kube-bins cni-plugins ## benchmarks as root: direct vs iptables vs eBPF (and the real istio-cni's enrolment); writes bench/results.json, bench/chart.svg, docs/BENCHMARKS.md and the README's table
	@mkdir -p bench
	AMBIENT_EBPF_BENCH=1 BENCH_RESULTS=$(CURDIR)/bench/results.json BENCH_DOC=$(CURDIR)/docs/BENCHMARKS.md BENCH_README=$(CURDIR)/README.md BENCH_CHART=$(CURDIR)/bench/chart.svg \
		CNI_PLUGINS_DIR=$(CNI_PLUGINS_DIR) $(GO) test -tags bench,istiocnireal -count=1 -timeout 40m -run '^TestBench$$' -v ./test/bench

# The sockmap acceleration's figures (--sockmap-accel off, ztunnel, both) on
# the eBPF path through the stand-in; same knobs as bench. Writes
# bench/sockmap.json (docs/BENCHMARKS.md, "Sockmap acceleration").
.PHONY: bench-sockmap
bench-sockmap: deps ## the sockmap acceleration's figures as root: off vs ztunnel vs both; writes bench/sockmap.json
	@mkdir -p bench
	AMBIENT_EBPF_BENCH=1 BENCH_SOCKMAP_RESULTS=$(CURDIR)/bench/sockmap.json \
		$(GO) test -tags bench -count=1 -timeout 20m -run '^TestBenchSockmap$$' -v ./test/bench

# The chaos soak (test/soak) for SOAK_DURATION with faults drawn from
# SOAK_SEED (default: the clock's; a failing run prints its seed). make test
# runs it for 100 s. The report goes to .cache/soak/.
SOAK_DURATION ?= 10m
.PHONY: soak
soak: deps kube-bins ## the chaos soak as root for SOAK_DURATION (default 10m; SOAK_SEED replays a run); report in .cache/soak/
	@mkdir -p $(CACHE)/soak
	SOAK_DURATION=$(SOAK_DURATION) SOAK_REPORT=$(CACHE)/soak/report-$$(date +%Y%m%dT%H%M%S).json \
		$(GO) test -race -count=1 -timeout 0 -run '^TestSoak$$' -v ./test/soak

.PHONY: test-kernels
test-kernels: deps ## run the kernel suites on the host kernel and, under qemu, on Debian's 5.10, 6.1 and 6.12 and the conformance suite on arm64's 6.12; the upgrade suites on 5.10, the takeover suite on 5.10, 6.1 and 6.12
	CACHE=$(CACHE) GO=$(GO) VMTEST_JOBS=$(VMTEST_JOBS) VMTEST_PKGS='$(VMTEST_PKGS)' VMTEST_ARM64_PKGS='$(VMTEST_ARM64_PKGS)' hack/vmtest/vmtest.sh $(VMTEST_KERNELS)

.PHONY: test-kernels-arm64
test-kernels-arm64: deps ## run every kernel suite (features, dataplane, conformance) on Debian's arm64 6.1 and 6.12 under qemu-system-aarch64
	CACHE=$(CACHE) GO=$(GO) VMTEST_ARM64_PKGS='./pkg/features ./pkg/dataplane ./test/conformance' hack/vmtest/vmtest.sh arm64-6.1 arm64-6.12

.PHONY: clean
clean: ## remove build outputs
	rm -rf bin
