// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package node

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Image references of the suite. The project's is the chart's default
// repository with a tag of ours; the others exist only on the test node.
const (
	ProjectImage = "ghcr.io/ambient-ebpf/ambient-ebpf:node-test"
	PauseImage   = "localhost/ambient-ebpf-test/pause:dev"
	EchoImage    = "localhost/ambient-ebpf-test/echo:dev"
	ClientImage  = "localhost/ambient-ebpf-test/client:dev"
	// AppBinary is where the test app sits in the pause, echo and client images.
	AppBinary = "/testapp"
)

// DockerBuild is what the repository's Dockerfile says the project's image
// is: the one `go build` of its build stage and the files, entry point and
// user of its final stage. The suite builds the image from it, so the two
// cannot drift.
type DockerBuild struct {
	Env        []string // KEY=VALUE before `go build`, build args expanded
	Flags      []string // go build flags, -o excluded
	OutDir     string   // the -o directory
	Targets    []string // ./cmd/... packages
	Files      []string // final stage paths of the copied binaries
	Entrypoint []string
	User       string
}

// ParseDockerfile reads the build of the project's image from a Dockerfile
// (two stages: a Go build stage, a final stage that copies its outputs).
func ParseDockerfile(text string) (*DockerBuild, error) {
	var instrs [][2]string
	var cur strings.Builder
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "#") || (line == "" && cur.Len() == 0) {
			continue
		}
		if cont, ok := strings.CutSuffix(line, `\`); ok {
			cur.WriteString(cont + " ")
			continue
		}
		cur.WriteString(line)
		cmd, args, _ := strings.Cut(strings.TrimSpace(cur.String()), " ")
		instrs = append(instrs, [2]string{strings.ToUpper(cmd), strings.TrimSpace(args)})
		cur.Reset()
	}
	b := &DockerBuild{}
	args := map[string]string{"TARGETOS": "linux", "TARGETARCH": runtime.GOARCH}
	// The build stage is the first, the image the last (the takeover
	// flavor's stage in between is not the default image).
	last := 0
	for _, in := range instrs {
		if in[0] == "FROM" {
			last++
		}
	}
	stages := 0
	for _, in := range instrs {
		cmd, rest := in[0], in[1]
		switch {
		case cmd == "FROM":
			stages++
		case cmd == "ARG" && stages > 0:
			k, v, ok := strings.Cut(rest, "=")
			if _, set := args[k]; ok && !set {
				args[k] = v
			}
		case cmd == "RUN" && stages == 1 && strings.Contains(rest, "go build"):
			words := shellWords(rest)
			i := slices.Index(words, "go")
			for _, w := range words[:i] {
				if k, v, ok := strings.Cut(w, "="); ok && !strings.HasPrefix(w, "--") && strings.ToUpper(k) == k {
					b.Env = append(b.Env, k+"="+os.Expand(v, func(n string) string { return args[n] }))
				}
			}
			for j := i + 2; j < len(words); j++ {
				switch w := words[j]; {
				case w == "-o" && j+1 < len(words):
					b.OutDir = words[j+1]
					j++
				case strings.HasPrefix(w, "./"):
					b.Targets = append(b.Targets, w)
				default:
					b.Flags = append(b.Flags, w)
				}
			}
		case cmd == "COPY" && stages == last && last > 1:
			f := strings.Fields(rest)
			if len(f) < 3 || !strings.HasPrefix(f[0], "--from=") {
				return nil, fmt.Errorf("final stage COPY %s: want --from=<build stage> SRC... DEST", rest)
			}
			for _, src := range f[1 : len(f)-1] {
				b.Files = append(b.Files, path.Join(f[len(f)-1], path.Base(src)))
			}
		case cmd == "ENTRYPOINT" && stages == last && last > 1:
			if err := json.Unmarshal([]byte(rest), &b.Entrypoint); err != nil {
				return nil, fmt.Errorf("ENTRYPOINT %s: want the exec form: %w", rest, err)
			}
		case cmd == "USER" && stages == last && last > 1:
			b.User = rest
		}
	}
	if stages < 2 || len(b.Targets) == 0 || len(b.Files) == 0 || len(b.Entrypoint) == 0 {
		return nil, fmt.Errorf("Dockerfile: %d stages, build targets %v, files %v, entry point %v: want a build stage and a final stage, a go build, a COPY and an ENTRYPOINT",
			stages, b.Targets, b.Files, b.Entrypoint)
	}
	return b, nil
}

// shellWords splits a RUN line on blanks, keeping double-quoted parts
// together without their quotes (the forms the Dockerfile uses).
func shellWords(s string) []string {
	var out []string
	var w strings.Builder
	quoted, inWord := false, false
	for _, r := range s {
		switch {
		case r == '"':
			quoted, inWord = !quoted, true
		case (r == ' ' || r == '\t') && !quoted:
			if inWord {
				out = append(out, w.String())
			}
			w.Reset()
			inWord = false
		default:
			w.WriteRune(r)
			inWord = true
		}
	}
	if inWord {
		out = append(out, w.String())
	}
	return out
}

// ImageArchs are the architectures of the project's image, an OCI index
// of one manifest each, as `docker buildx build --platform
// linux/amd64,linux/arm64` makes it.
var ImageArchs = []string{"amd64", "arm64"}

// Build runs the Dockerfile's go build from the module at repo into dir,
// for arch as the build's TARGETARCH.
func (b *DockerBuild) Build(repo, dir, arch string) error {
	args := append(append([]string{"build"}, b.Flags...), "-o", dir+"/")
	cmd := exec.Command("go", append(args, b.Targets...)...)
	cmd.Dir = repo
	env := slices.DeleteFunc(slices.Clone(b.Env), func(kv string) bool { return strings.HasPrefix(kv, "GOARCH=") })
	cmd.Env = append(append(os.Environ(), env...), "GOARCH="+arch)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go %s: %w: %s", strings.Join(cmd.Args[1:], " "), err, out)
	}
	return nil
}

// file is one regular file of an image layer.
type file struct {
	path string // absolute, in the image
	src  string // on the host
}

// newImage makes an image of one layer holding files (executables) for
// linux/arch.
func newImage(ref, arch string, files []file, entrypoint []string, user string) (v1.Image, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	mtime := time.Unix(0, 0)
	for _, f := range files {
		var parents []string
		for d := path.Dir(f.path); d != "/"; d = path.Dir(d) {
			parents = append([]string{d}, parents...)
		}
		for _, d := range parents {
			if !dirs[d] {
				dirs[d] = true
				if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: strings.TrimPrefix(d, "/") + "/", Mode: 0o755, ModTime: mtime}); err != nil {
					return nil, err
				}
			}
		}
		b, err := os.ReadFile(f.src)
		if err != nil {
			return nil, err
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: strings.TrimPrefix(f.path, "/"), Mode: 0o755, Size: int64(len(b)), ModTime: mtime}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(b); err != nil {
			return nil, err
		}
	}
	// /tmp exists in distroless static too.
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777, ModTime: mtime}); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(buf.Bytes())), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, fmt.Errorf("image %s (%s): layer: %w", ref, arch, err)
	}
	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	if img, err = mutate.AppendLayers(img, layer); err != nil {
		return nil, fmt.Errorf("image %s (%s): %w", ref, arch, err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", arch
	cf.Config.Entrypoint, cf.Config.User = entrypoint, user
	cf.Config.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin"}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return nil, fmt.Errorf("image %s (%s): config: %w", ref, arch, err)
	}
	return img, nil
}

// writeImage writes a single-architecture image (the host's) of files as
// an OCI image layout in a tar archive at out, named ref for containerd.
func writeImage(out, ref string, files []file, entrypoint []string, user string) error {
	img, err := newImage(ref, runtime.GOARCH, files, entrypoint, user)
	if err != nil {
		return err
	}
	return writeLayout(out, ref, func(p layout.Path, o layout.Option) error { return p.AppendImage(img, o) })
}

// writeIndex writes a multi-architecture image, one manifest per entry of
// byArch (its files), as an OCI image index in an OCI image layout in a
// tar archive at out, named ref for containerd: the runtime unpacks the
// manifest of its node's platform.
func writeIndex(out, ref string, byArch map[string][]file, entrypoint []string, user string) error {
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, arch := range slices.Sorted(maps.Keys(byArch)) {
		img, err := newImage(ref, arch, byArch[arch], entrypoint, user)
		if err != nil {
			return err
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: arch}}})
	}
	return writeLayout(out, ref, func(p layout.Path, o layout.Option) error { return p.AppendIndex(idx, o) })
}

// writeLayout writes an OCI image layout holding what add appends to it
// (named ref) as a tar archive at out.
func writeLayout(out, ref string, add func(layout.Path, layout.Option) error) error {
	dir, err := os.MkdirTemp(filepath.Dir(out), "layout-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return fmt.Errorf("image %s: layout: %w", ref, err)
	}
	if err := add(p, layout.WithAnnotations(map[string]string{
		"io.containerd.image.name":          ref,
		"org.opencontainers.image.ref.name": ref,
	})); err != nil {
		return fmt.Errorf("image %s: write: %w", ref, err)
	}
	return tarDir(dir, out)
}

// tarDir writes the tree at dir into a tar archive at out.
func tarDir(dir, out string) error {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		h, err := tar.FileInfoHeader(info, "")
		if err != nil {
			return err
		}
		h.Name, _ = filepath.Rel(dir, p)
		if d.IsDir() {
			h.Name += "/"
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		src, err := os.Open(p)
		if err != nil {
			return err
		}
		defer src.Close()
		_, err = io.Copy(tw, src)
		return err
	})
	if err != nil {
		return fmt.Errorf("tar %s: %w", dir, err)
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return f.Close()
}

// ImageContent is one architecture's image of an archive written by
// writeIndex or writeImage, for the Dockerfile test.
type ImageContent struct {
	Arch       string            // the manifest's platform (a single image's config) architecture
	ConfigArch string            // the image config's architecture
	Files      []string          // regular files
	Machines   map[string]string // ELF machine of each executable file (elfMachine)
	Entrypoint []string
	User       string
}

// ImageFiles reads every manifest of an image archive: the platforms of
// an index, or the one image.
func ImageFiles(archive string) ([]ImageContent, error) {
	dir, err := os.MkdirTemp(filepath.Dir(archive), "read-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	if out, err := exec.Command("tar", "-xf", archive, "-C", dir).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("untar %s: %w: %s", archive, err, out)
	}
	p, err := layout.FromPath(dir)
	if err != nil {
		return nil, err
	}
	top, err := p.ImageIndex()
	if err != nil {
		return nil, err
	}
	m, err := top.IndexManifest()
	if err != nil || len(m.Manifests) != 1 {
		return nil, fmt.Errorf("image layout of %s: %d entries, want 1: %v", archive, len(m.Manifests), err)
	}
	d := m.Manifests[0]
	if !d.MediaType.IsIndex() {
		img, err := top.Image(d.Digest)
		if err != nil {
			return nil, err
		}
		c, err := readImage(img, "")
		if err != nil {
			return nil, err
		}
		return []ImageContent{c}, nil
	}
	idx, err := top.ImageIndex(d.Digest)
	if err != nil {
		return nil, err
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	var out []ImageContent
	for _, md := range im.Manifests {
		if md.Platform == nil {
			return nil, fmt.Errorf("image index of %s: manifest %s names no platform", archive, md.Digest)
		}
		img, err := idx.Image(md.Digest)
		if err != nil {
			return nil, err
		}
		c, err := readImage(img, md.Platform.Architecture)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

// readImage lists one image's files, the ELF machine of each executable,
// its entry point and user.
func readImage(img v1.Image, arch string) (ImageContent, error) {
	c := ImageContent{Arch: arch, Machines: map[string]string{}}
	cf, err := img.ConfigFile()
	if err != nil {
		return c, err
	}
	c.ConfigArch, c.Entrypoint, c.User = cf.Architecture, cf.Config.Entrypoint, cf.Config.User
	if c.Arch == "" { // a single image: its config names it
		c.Arch = c.ConfigArch
	}
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return c, err
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		c.Files = append(c.Files, "/"+h.Name)
		head := make([]byte, 20)
		if n, _ := io.ReadFull(tr, head); n == len(head) {
			if m := elfMachine(head); m != "" {
				c.Machines["/"+h.Name] = m
			}
		}
	}
	return c, nil
}

// elfMachine names the architecture of an ELF header by Go's name, ""
// for anything else.
func elfMachine(head []byte) string {
	if len(head) < 20 || string(head[:4]) != "\x7fELF" || head[5] != 1 { // little-endian only
		return ""
	}
	switch elf.Machine(binary.LittleEndian.Uint16(head[18:20])) {
	case elf.EM_X86_64:
		return "amd64"
	case elf.EM_AARCH64:
		return "arm64"
	}
	return "other"
}

// Archives are the suite's images as OCI archives.
type Archives struct {
	Project, Pause, Echo, Client string
	// Ztunnel is the ztunnel stand-in's binary (test/ztunnel), run on the
	// node as a process.
	Ztunnel string
	// Dockerfile is the build the project's image followed.
	Dockerfile *DockerBuild
}

// All returns every archive.
func (a *Archives) All() []string { return []string{a.Project, a.Pause, a.Echo, a.Client} }

// BuildImages builds the project's image from the Dockerfile at repo (its
// go build, its files, entry point and user; the base image is left out:
// no registry is reachable, and the binaries are static) and the test
// images, into dir.
func BuildImages(repo, dir string) (*Archives, error) {
	raw, err := os.ReadFile(filepath.Join(repo, "Dockerfile"))
	if err != nil {
		return nil, err
	}
	db, err := ParseDockerfile(string(raw))
	if err != nil {
		return nil, err
	}
	a := &Archives{Dockerfile: db}
	byArch := map[string][]file{}
	for _, arch := range ImageArchs {
		bin := filepath.Join(dir, "bin", arch)
		if err := db.Build(repo, bin, arch); err != nil {
			return nil, err
		}
		for _, f := range db.Files {
			byArch[arch] = append(byArch[arch], file{path: f, src: filepath.Join(bin, path.Base(f))})
		}
	}
	a.Project = filepath.Join(dir, "project.tar")
	if err := writeIndex(a.Project, ProjectImage, byArch, db.Entrypoint, db.User); err != nil {
		return nil, err
	}
	app := filepath.Join(dir, "testapp")
	cmd := exec.Command("go", "build", "-trimpath", "-o", app, "./test/node/testapp")
	cmd.Dir = repo
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("build the test app: %w: %s", err, out)
	}
	a.Ztunnel = filepath.Join(dir, "ztunnel")
	cmd = exec.Command("go", "build", "-trimpath", "-o", a.Ztunnel, "./test/ztunnel")
	cmd.Dir = repo
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("build the ztunnel stand-in: %w: %s", err, out)
	}
	appFiles := []file{{path: AppBinary, src: app}}
	for _, img := range []struct {
		out *string
		ref string
		ep  []string
	}{
		{&a.Pause, PauseImage, []string{AppBinary, "pause"}},
		{&a.Echo, EchoImage, []string{AppBinary, "serve", "echo", ":8080", ":8081"}},
		{&a.Client, ClientImage, []string{AppBinary, "pause"}},
	} {
		*img.out = filepath.Join(dir, path.Base(strings.Split(img.ref, ":")[0])+".tar")
		if err := writeImage(*img.out, img.ref, appFiles, img.ep, "65535"); err != nil {
			return nil, err
		}
	}
	return a, nil
}
