// Command etcd wraps go.etcd.io/etcd/server/v3 so it can be built from the Go
// module proxy for the end-to-end tests (test/kubeapi).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
