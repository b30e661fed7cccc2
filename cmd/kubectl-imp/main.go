// Command kubectl-imp is the kubectl plugin for ImpVMs: `kubectl imp VERB` (see
// internal/kubectlimp).
package main

import (
	"os"

	"github.com/syscode-labs/imp/internal/kubectlimp"
)

func main() {
	if err := kubectlimp.NewCommand(os.Stdout, os.Stderr).Execute(); err != nil {
		os.Exit(1)
	}
}
