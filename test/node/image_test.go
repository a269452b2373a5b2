// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package node

import (
	"os"
	"path"
	"path/filepath"
	"slices"
	"testing"
)

// TestImageFollowsDockerfile holds the suite's image and the Dockerfile
// together: the image the suite runs is built from the Dockerfile's go
// build, holds exactly the files its final stage copies, with its entry
// point and user, and the chart runs that entry point.
func TestImageFollowsDockerfile(t *testing.T) {
	if imagesErr != nil {
		t.Fatalf("build images: %v", imagesErr)
	}
	db := images.Dockerfile
	contents, err := ImageFiles(images.Project)
	if err != nil {
		t.Fatal(err)
	}
	// One manifest per architecture, each the Dockerfile's final stage
	// with binaries built for it.
	var archs []string
	for _, c := range contents {
		archs = append(archs, c.Arch)
		if c.ConfigArch != c.Arch {
			t.Errorf("the %s manifest's config says %s", c.Arch, c.ConfigArch)
		}
		if !slices.Equal(sortedCopy(c.Files), sortedCopy(db.Files)) {
			t.Errorf("%s image holds %v, the Dockerfile's final stage %v", c.Arch, c.Files, db.Files)
		}
		if !slices.Equal(c.Entrypoint, db.Entrypoint) || c.User != db.User {
			t.Errorf("%s image entry point %v user %q, Dockerfile %v %q", c.Arch, c.Entrypoint, c.User, db.Entrypoint, db.User)
		}
		for _, f := range db.Files {
			if got := c.Machines[f]; got != c.Arch {
				t.Errorf("%s image: %s is an ELF for %q", c.Arch, f, got)
			}
		}
	}
	if !slices.Equal(sortedCopy(archs), sortedCopy(ImageArchs)) {
		t.Errorf("the image index holds %v, want %v", archs, ImageArchs)
	}
	// Each file is the build of the target of the same name.
	for _, f := range db.Files {
		if !slices.Contains(db.Targets, "./cmd/"+path.Base(f)) {
			t.Errorf("%s is not built by the Dockerfile's go build (%v)", f, db.Targets)
		}
	}
	for _, want := range []string{"CGO_ENABLED=0", "GOOS=linux"} {
		if !slices.Contains(db.Env, want) {
			t.Errorf("go build environment %v lacks %s", db.Env, want)
		}
	}
	if !slices.Contains(db.Flags, "-trimpath") {
		t.Errorf("go build flags %v lack -trimpath", db.Flags)
	}
	raw, err := os.ReadFile(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	if again, err := ParseDockerfile(string(raw)); err != nil || !slices.Equal(again.Files, db.Files) {
		t.Fatalf("parse the Dockerfile again: %v", err)
	}
	ch, err := RenderChart(filepath.Join(repoRoot, "deploy", "ambient-ebpf"), "")
	if err != nil {
		t.Fatal(err)
	}
	c := ch.DaemonSet.Spec.Template.Spec.Containers[0]
	if !slices.Equal(c.Command, db.Entrypoint) {
		t.Errorf("the chart runs %v, the image's entry point is %v", c.Command, db.Entrypoint)
	}
}

// TestParseDockerfile checks the parts of the build the parser reads.
func TestParseDockerfile(t *testing.T) {
	db, err := ParseDockerfile(`ARG GO_IMAGE=golang:1.26
FROM ${GO_IMAGE} AS build
ARG TARGETARCH
RUN --mount=type=cache,target=/go/pkg/mod \
    CGO_ENABLED=0 GOOS=${TARGETOS} GOARCH=${TARGETARCH} \
    go build -trimpath -ldflags="-s -w" -o /out/ ./cmd/a ./cmd/b
FROM scratch
COPY --from=build /out/a /out/b /usr/local/bin/
USER 0:0
ENTRYPOINT ["/usr/local/bin/a"]
`)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(db.Flags, []string{"-trimpath", "-ldflags=-s -w"}) || db.OutDir != "/out/" ||
		!slices.Equal(db.Targets, []string{"./cmd/a", "./cmd/b"}) || !slices.Equal(db.Files, []string{"/usr/local/bin/a", "/usr/local/bin/b"}) ||
		db.User != "0:0" || !slices.Equal(db.Entrypoint, []string{"/usr/local/bin/a"}) || len(db.Env) != 3 || db.Env[1] != "GOOS=linux" {
		t.Errorf("parsed %+v", db)
	}
	if _, err := ParseDockerfile("FROM scratch\n"); err == nil {
		t.Error("a Dockerfile without a build parsed")
	}
}

func sortedCopy(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}
