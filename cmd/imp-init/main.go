// Command imp-init is PID 1 inside every IMP guest, shipped in the initramfs the agent boots
// with: it mounts the root filesystem, runs the image's entrypoint, reaps zombies, forwards
// signals and serves the guest end of the guest channel (see internal/guestinit).
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/syscode-labs/imp/internal/guestinit"
)

func main() {
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "Usage: imp-init\n\nPID 1 of an IMP guest; configured from the kernel command line and the VM's disk, not from flags.\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.Arg(0) == guestinit.GuestSideArg {
		// Started by an OS's init (ImpVM spec.boot OS) as the guest side.
		if err := guestinit.RunGuestSide(); err != nil {
			fmt.Fprintln(os.Stderr, "imp-init guest side:", err)
			os.Exit(1)
		}
		return
	}
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "imp-init: runs only as PID 1 inside an IMP guest")
		os.Exit(2)
	}
	guestinit.Run()
}
