// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kubeapi

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func fakeBins(t *testing.T, apiserver string) string {
	t.Helper()
	dir := t.TempDir()
	for name, script := range map[string]string{
		"etcd":           "#!/bin/sh\nexec sleep 60\n",
		"kube-apiserver": apiserver,
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestFindBinariesPrefersTheEnvironment(t *testing.T) {
	dir := fakeBins(t, "#!/bin/sh\n")
	t.Setenv(BinsEnv, dir)
	got, err := FindBinaries()
	if err != nil || got != dir {
		t.Errorf("FindBinaries = %q, %v; want %q", got, err, dir)
	}
}

func TestStartWithoutBinariesSaysSo(t *testing.T) {
	t.Setenv(BinsEnv, t.TempDir())
	t.Chdir(t.TempDir())
	if _, err := Start(context.Background()); !errors.Is(err, ErrNoBinaries) {
		t.Errorf("Start = %v; want ErrNoBinaries", err)
	}
}

func TestStartReportsAServerThatExitsWithItsLog(t *testing.T) {
	t.Setenv(BinsEnv, fakeBins(t, "#!/bin/sh\necho 'bind: address already in use' >&2\nexit 1\n"))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Start(ctx)
	if err == nil {
		c.Stop()
		t.Fatal("Start succeeded with an api server that exits")
	}
	if !strings.Contains(err.Error(), "address already in use") || strings.Count(err.Error(), "exited") != 3 {
		t.Errorf("Start error = %v; want three attempts, each with the server's log", err)
	}
}
