// Command kubelet wraps k8s.io/kubernetes' kubelet so it can be built from
// the Go module proxy for the real-node suite (test/node), as
// hack/tools/kube-apiserver does for the API server. k8s.io/kubernetes' own
// go.mod carries ./staging replace directives, which is why
// `go install k8s.io/kubernetes/cmd/kubelet@v1.37.2` fails.
package main

import (
	"context"
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	// NewKubeletCommand panics on a nil context.
	os.Exit(cli.Run(app.NewKubeletCommand(context.Background())))
}
