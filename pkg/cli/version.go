// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
)

// setVersion gives the root command --version, from the binary's build
// information.
func setVersion(root *cobra.Command) {
	root.Version = buildinfo.Read().String()
	root.SetVersionTemplate("{{.Name}} {{.Version}}\n")
}

func versionCommand(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "The CLI's version, revision, Go version and platform, from its build information",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			info := buildinfo.Read()
			return o.emit(cmd.OutOrStdout(), info, func(w *tabwriter.Writer) {
				fmt.Fprintf(w, "version\t%s\n", info.Version)
				fmt.Fprintf(w, "revision\t%s\n", dashIfEmpty(info.Revision))
				fmt.Fprintf(w, "modified\t%v\n", info.Modified)
				fmt.Fprintf(w, "commit time\t%s\n", dashIfEmpty(info.Time))
				fmt.Fprintf(w, "go\t%s\n", info.GoVersion)
				fmt.Fprintf(w, "platform\t%s\n", dashIfEmpty(info.Platform))
			})
		},
	}
}

func dashIfEmpty(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
