// Command fakejailer is fctest.FakeJailer as a binary, for agent tests on machines without KVM.
package main

import (
	"os"

	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker/fctest"
)

func main() { os.Exit(fctest.FakeJailer(os.Args[1:])) }
