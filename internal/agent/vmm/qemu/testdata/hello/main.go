// Command hello is the workload of the QEMU boot test: it shows what imp-init gave it, leaves an
// orphan for PID 1 to reap, and exits with code 3.
package main

import (
	"fmt"
	"os"
	"os/exec"
)

func main() {
	host, _ := os.Hostname()
	wd, _ := os.Getwd()
	fmt.Printf("hello from imp: GREETING=%s host=%s pid=%d uid=%d wd=%s\n", os.Getenv("GREETING"), host, os.Getpid(), os.Getuid(), wd)
	if err := os.WriteFile("written-by-guest", []byte("upper layer\n"), 0o644); err != nil {
		fmt.Println("write failed:", err)
	}
	if len(os.Args) > 1 && os.Args[1] == "orphan" {
		_ = exec.Command("/bin/hello", "child").Start() // exits at once; init reaps it
	}
	os.Exit(3)
}
