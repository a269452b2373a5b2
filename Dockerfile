# syntax=docker/dockerfile:1
#
# The ambient-ebpf image: the node agent, the CNI plugin (the agent's
# installer copies it into the host's CNI bin directory) and the CLI.
#
# The BPF objects are committed (pkg/dataplane/**/*_bpfel.o, embedded by
# bpf2go's generated Go), so the build needs Go only: no clang, no headers.
# All three binaries are static (CGO_ENABLED=0) and the agent shells out to
# nothing (no iptables, ip, tc or mount binaries), so the final image is
# distroless static: no shell, no package manager. The takeover flavor below
# adds the iptables and nft binaries a takeover from istio-cni needs.
#
#   docker build -t ghcr.io/ambient-ebpf/ambient-ebpf:dev .
#   docker buildx build --platform linux/amd64,linux/arm64 ...
#
# deploy/dockerfile_test.go keeps the build targets below in step with cmd/.

ARG GO_IMAGE=golang:1.26
ARG BASE_IMAGE=gcr.io/distroless/static-debian13
ARG TAKEOVER_BASE_IMAGE=debian:trixie-slim

FROM --platform=$BUILDPLATFORM ${GO_IMAGE} AS build
ARG TARGETOS=linux
ARG TARGETARCH
# The version stamped into the binaries (`make image` passes hack/version.sh's;
# the context has no .git to take it from).
ARG VERSION=(devel)
ARG REVISION=
WORKDIR /src
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
# Cross-compiles for the target platform (BPF objects are little-endian:
# amd64, arm64 and the other little-endian architectures).
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 GOOS=${TARGETOS} GOARCH=${TARGETARCH} \
    go build -trimpath -ldflags="-s -w -X github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo.stampedVersion=${VERSION} -X github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo.stampedRevision=${REVISION}" -o /out/ \
        ./cmd/ambient-ebpf-agent \
        ./cmd/ambient-ebpf-cni \
        ./cmd/ambient-ebpf-cni-fallback \
        ./cmd/ambient-ebpf

# The takeover flavor (tag suffix -takeover, chart image.flavor=takeover):
# the same binaries on Debian slim with the iptables and nft binaries, which
# reading and removing istio-cni's rules in place needs (pkg/istiocni runs
# iptables-save/-restore of both backends and nft; --istio-cni-takeover and
# --istio-cni-handback). Built with --target takeover.
FROM ${TAKEOVER_BASE_IMAGE} AS takeover
RUN apt-get update && apt-get install -y --no-install-recommends iptables nftables && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ambient-ebpf-agent /out/ambient-ebpf-cni /out/ambient-ebpf-cni-fallback /out/ambient-ebpf /usr/local/bin/
USER 0:0
ENTRYPOINT ["/usr/local/bin/ambient-ebpf-agent"]

FROM ${BASE_IMAGE}
COPY --from=build /out/ambient-ebpf-agent /out/ambient-ebpf-cni /out/ambient-ebpf-cni-fallback /out/ambient-ebpf /usr/local/bin/
# Root, with capabilities granted by the pod spec (see the chart's README);
# distroless static's default user is already 0, this makes it explicit.
USER 0:0
ENTRYPOINT ["/usr/local/bin/ambient-ebpf-agent"]
