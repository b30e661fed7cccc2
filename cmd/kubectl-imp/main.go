// Command kubectl-imp is the kubectl plugin for ImpVMs: `kubectl imp VERB`.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

func main() {
	root := &cobra.Command{
		Use:   "kubectl imp",
		Short: "Act on IMP microVMs",
		Long: `kubectl imp acts on ImpVMs the way a VM user expects: console, logs, stop, start,
restart, suspend, resume and status. Until the verbs land, use kubectl get/describe impvm.`,
		SilenceUsage: true,
	}
	if err := root.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
