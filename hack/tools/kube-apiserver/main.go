// Command kube-apiserver wraps k8s.io/kubernetes' API server so it can be
// built from the Go module proxy for the end-to-end tests (test/kubeapi).
// k8s.io/kubernetes' own go.mod carries ./staging replace directives, which
// is why `go install k8s.io/kubernetes/cmd/kube-apiserver@v1.37.2` fails.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	os.Exit(cli.Run(app.NewAPIServerCommand()))
}
