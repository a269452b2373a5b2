# ambient-ebpf build, test and demo entry points. `make help` lists them.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

GO        ?= go
# bpf2go reads these from the environment; clang is pinned so the committed
# objects are reproducible (`make check-generated`).
BPF2GO_CC    ?= clang-19
BPF2GO_STRIP ?= llvm-strip-19
BPF2GO_CFLAGS ?= -O2 -g -Wall -Werror
export BPF2GO_CC BPF2GO_STRIP BPF2GO_CFLAGS

# Packages whose go:generate lines run bpf2go.
GEN_PKGS  := ./pkg/dataplane/...
APT_PKGS  := clang-19 llvm-19 libbpf-dev bpftool iproute2 iptables ipset protobuf-compiler \
	qemu-system-x86 busybox-static cpio kmod xz-utils
# Kernels `make test-kernels` runs the kernel suites on: the host's, then
# Debian's cloud kernels under qemu (see hack/vmtest/vmtest.sh).
VMTEST_KERNELS ?= host 5.10 6.1 6.12
CACHE     := $(CURDIR)/.cache
GOTESTFLAGS ?= -race -count=1 -timeout 40m
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

.PHONY: generate
generate: ## run bpf2go (clang-19) for every BPF object; outputs are committed
	$(GO) generate $(GEN_PKGS)

.PHONY: check-generated
check-generated: ## regenerate the BPF objects in a scratch copy and fail on any difference
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} cp --parents {} "$$tmp"/ 2>/dev/null || true; \
	cd "$$tmp" && $(GO) generate $(GEN_PKGS) && \
	if ! git -C "$(CURDIR)" diff --no-index --stat -- "$(CURDIR)/pkg" "$$tmp/pkg" >/dev/null 2>&1; then \
		git -C "$(CURDIR)" diff --no-index --stat -- "$(CURDIR)/pkg" "$$tmp/pkg" || true; \
		echo "check-generated: bpf2go outputs are stale; run 'make generate' and commit"; exit 1; \
	fi; echo "check-generated: bpf2go outputs are up to date"

.PHONY: build
build: ## build all binaries into bin/
	@mkdir -p bin
	$(GO) build -trimpath -o bin/ ./cmd/...

.PHONY: vet
vet: ## go vet and gofmt
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt needed"; exit 1; }
	$(GO) vet ./...

.PHONY: test
test: deps vet ## run every test, kernel suites included (as root); the README's test command
	$(GO) build -o $(CACHE)/bin/testreport ./hack/testreport
	$(GO) test $(GOTESTFLAGS) -json ./... 2>&1 | $(CACHE)/bin/testreport $(TESTREPORT_FLAGS)

.PHONY: test-kernels
test-kernels: deps ## run the kernel suites on the host kernel and, under qemu, on Debian's 5.10, 6.1 and 6.12
	CACHE=$(CACHE) GO=$(GO) hack/vmtest/vmtest.sh $(VMTEST_KERNELS)

.PHONY: clean
clean: ## remove build outputs
	rm -rf bin
