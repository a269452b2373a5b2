// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package decide

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/fallback"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podfile"
)

func TestKubeSourceReadsPodAndNamespaceWithTheToken(t *testing.T) {
	var auth []string
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		auth = append(auth, r.Header.Get("Authorization"))
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/api/v1/namespaces/mesh/pods/web":
			fmt.Fprint(w, `{"apiVersion":"v1","kind":"Pod","metadata":{"name":"web","namespace":"mesh","uid":"u1"}}`)
		case "/api/v1/namespaces/mesh":
			fmt.Fprint(w, `{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"mesh","labels":{"istio.io/dataplane-mode":"ambient"}}}`)
		default:
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprintf(w, `{"apiVersion":"v1","kind":"Status","status":"Failure","reason":"NotFound","code":404,"message":"pod %s is not on this API server"}`, path.Base(r.URL.Path))
		}
	}))
	defer srv.Close()
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	ca := base64.StdEncoding.EncodeToString(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}))
	kubeconfig := "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: " + srv.URL + ", certificate-authority-data: " + ca + "}}]\n" +
		"users: [{name: u, user: {token: tok-1}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n"
	if err := os.WriteFile(kc, []byte(kubeconfig), 0o600); err != nil {
		t.Fatal(err)
	}
	src, err := NewKubeSource(kc)
	if err != nil {
		t.Fatal(err)
	}
	p, ns, err := src.Lookup(context.Background(), "mesh", "web")
	if err != nil {
		t.Fatal(err)
	}
	if p.UID != "u1" || ns.Labels["istio.io/dataplane-mode"] != "ambient" {
		t.Errorf("pod %v, namespace %v", p, ns)
	}
	if len(auth) != 2 || auth[0] != "Bearer tok-1" {
		t.Errorf("authorization headers = %v", auth)
	}
	if _, _, err := src.Lookup(context.Background(), "mesh", "ghost"); !apierrors.IsNotFound(err) || !strings.Contains(err.Error(), "mesh/ghost") ||
		!strings.Contains(err.Error(), "pod ghost is not on this API server") {
		t.Errorf("missing pod: %v, want the API server's NotFound status", err)
	}
}

func TestFileSource(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pods.yaml")
	doc := "apiVersion: v1\nkind: Namespace\nmetadata: {name: mesh, labels: {istio.io/dataplane-mode: ambient}}\n---\n" +
		"apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: mesh}\n"
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	p, ns, err := podfile.FileLookup(path).Lookup(context.Background(), "mesh", "web")
	if err != nil || p.Name != "web" || ns == nil {
		t.Fatalf("Lookup = %v, %v, %v", p, ns, err)
	}
	if _, _, err := podfile.FileLookup(path).Lookup(context.Background(), "mesh", "ghost"); err == nil {
		t.Error("pod missing from the file was found")
	}
}

// The binary's protocol: one request in, one decision out; a decision that
// cannot be made is an answer with its reason, not a failure.
func TestRunAnswersEachRequest(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pods.yaml")
	doc := "apiVersion: v1\nkind: Namespace\nmetadata: {name: mesh, labels: {istio.io/dataplane-mode: ambient}}\n---\n" +
		"apiVersion: v1\nkind: Namespace\nmetadata: {name: plain}\n---\n" +
		"apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: mesh}\n---\n" +
		"apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: plain}\n---\n" +
		"apiVersion: v1\nkind: Pod\nmetadata: {name: named, namespace: mesh, uid: u-named}\n"
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		req  fallback.Request
		want fallback.Response
	}{
		{fallback.Request{Namespace: "mesh", Name: "web", PodFile: path}, fallback.Response{Ambient: true, Reason: "namespace labelled ambient"}},
		{fallback.Request{Namespace: "plain", Name: "web", PodFile: path}, fallback.Response{Reason: "neither pod nor namespace labelled ambient"}},
		{fallback.Request{Namespace: "mesh", Name: "web", PodFile: path, ExcludeNamespaces: []string{"mesh"}}, fallback.Response{Reason: "namespace excluded"}},
		{fallback.Request{Namespace: "mesh", Name: "ghost", PodFile: path}, fallback.Response{Error: "pod mesh/ghost not in pod file " + path}},
		{fallback.Request{Namespace: "mesh", Name: "web"}, fallback.Response{Error: "no kubeconfig or pod file configured to read the pod"}},
		// K8S_POD_UID must be the read pod's, when the source names one.
		{fallback.Request{Namespace: "mesh", Name: "named", UID: "u-named", PodFile: path}, fallback.Response{Ambient: true, Reason: "namespace labelled ambient"}},
		{fallback.Request{Namespace: "mesh", Name: "named", UID: "u-newer", PodFile: path}, fallback.Response{Error: "pod mesh/named: the runtime names uid u-newer, the read pod has uid u-named"}},
		{fallback.Request{Namespace: "mesh", Name: "web", UID: "u-any", PodFile: path}, fallback.Response{Ambient: true, Reason: "namespace labelled ambient"}},
	}
	for _, tc := range cases {
		in, _ := json.Marshal(tc.req)
		var out bytes.Buffer
		if err := Run(context.Background(), bytes.NewReader(in), &out); err != nil {
			t.Fatalf("Run(%+v): %v", tc.req, err)
		}
		var got fallback.Response
		if err := json.Unmarshal(out.Bytes(), &got); err != nil {
			t.Fatal(err)
		}
		if got != tc.want {
			t.Errorf("Run(%+v) = %+v, want %+v", tc.req, got, tc.want)
		}
	}
	if err := Run(context.Background(), strings.NewReader("{"), &bytes.Buffer{}); err == nil {
		t.Error("Run accepted a broken request")
	}
}
