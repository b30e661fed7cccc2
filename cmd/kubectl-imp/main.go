// Command kubectl-imp is the kubectl plugin for ImpVMs: `kubectl imp VERB` (see
// internal/kubectlimp).
package main

import (
	"errors"
	"os"

	"github.com/syscode-labs/imp/internal/kubectlimp"
)

func main() {
	if err := kubectlimp.NewCommand(os.Stdin, os.Stdout, os.Stderr).Execute(); err != nil {
		// exec exits with the code of the command it ran.
		var exit *kubectlimp.ExitError
		if errors.As(err, &exit) {
			os.Exit(exit.Code)
		}
		os.Exit(1)
	}
}
