// Command imp-agent is IMP's privileged node agent (DaemonSet imp-runtime): it makes its node
// match the ImpVMs placed on it — disks from OCI images, host networking, VMM processes, the
// guest channel — and reports what it observes.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"

	"github.com/syscode-labs/imp/internal/logging"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "imp-agent:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		nodeName, stateDir string
		logOpts            logging.Options
	)
	fs := flag.CommandLine
	fs.StringVar(&nodeName, "node-name", os.Getenv("NODE_NAME"), "name of the node this agent runs on (default $NODE_NAME)")
	fs.StringVar(&stateDir, "state-dir", "/var/lib/imp", "host directory holding per-VM state, disks and images")
	logOpts.BindFlags(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: imp-agent [flags]\n\nRuns the ImpVMs placed on this node.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	flag.Parse()
	if _, err := logOpts.Logger(); err != nil {
		return err
	}
	if nodeName == "" {
		return errors.New("--node-name (or $NODE_NAME) is required")
	}
	return errors.New("the node agent's control loop is not built yet (issue 4)")
}
