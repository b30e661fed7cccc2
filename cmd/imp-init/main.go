// Command imp-init is PID 1 inside every IMP guest, shipped in the initramfs the agent boots
// with: it mounts the root filesystem, configures the network, runs the image's entrypoint,
// reaps zombies and serves the guest end of the guest channel.
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "Usage: imp-init\n\nPID 1 of an IMP guest; configured from the kernel command line, not from flags.\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "imp-init: runs only as PID 1 inside an IMP guest")
		os.Exit(2)
	}
	fmt.Fprintln(os.Stderr, "imp-init: the guest init is not built yet (issue 4)")
	os.Exit(1)
}
