// Command hello is the workload of IMP's guest tests. It prints what imp-init gave it and
// writes a file in its working directory; then, by its first argument:
//
//	exit    leaves an orphan for PID 1 to reap and exits with code 3
//	serve   prints a line a second until SIGTERM, then exits 0
//	stubborn prints a line a second and ignores SIGTERM
//	net     serves TCP on :7000 (greeting "hello from <host name>") and probes the targets
//	        of $PROBE (comma-separated icmp:A.B.C.D[-N], tcp:HOST:PORT and who:HOST:PORT,
//	        which reads another guest's greeting) twice a second, printing each change
//	        "probe <target> ok|ok <greeter>|fail", and a tick a second, until SIGTERM
package main

import (
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	host, _ := os.Hostname()
	wd, _ := os.Getwd()
	fmt.Printf("hello from imp: GREETING=%s host=%s pid=%d uid=%d wd=%s\n", os.Getenv("GREETING"), host, os.Getpid(), os.Getuid(), wd)
	if prev, err := os.ReadFile("written-by-guest"); err == nil {
		fmt.Printf("hello: found an earlier write: %s", prev)
	} else {
		fmt.Println("hello: no earlier write")
	}
	if err := os.WriteFile("written-by-guest", []byte("upper layer of "+host+"\n"), 0o644); err != nil {
		fmt.Println("write failed:", err)
	}
	mode := "exit"
	if len(os.Args) > 1 {
		mode = os.Args[1]
	}
	switch mode {
	case "serve":
		term := make(chan os.Signal, 1)
		signal.Notify(term, syscall.SIGTERM)
		for i := 0; ; i++ {
			select {
			case <-term:
				fmt.Println("hello: terminating")
				os.Exit(0)
			case <-time.After(time.Second):
				fmt.Printf("hello: tick %d\n", i)
			}
		}
	case "stubborn":
		signal.Ignore(syscall.SIGTERM)
		for i := 0; ; i++ {
			time.Sleep(time.Second)
			fmt.Printf("hello: tick %d\n", i)
		}
	case "net":
		term := make(chan os.Signal, 1)
		signal.Notify(term, syscall.SIGTERM)
		go serveTCP(host)
		go probeLoop(os.Getenv("PROBE"))
		go func() {
			for i := 0; ; i++ {
				time.Sleep(time.Second)
				fmt.Printf("hello: tick %d\n", i)
			}
		}()
		<-term
		fmt.Println("hello: terminating")
		os.Exit(0)
	case "child":
		return
	default:
		_ = exec.Command("/bin/hello", "child").Start() // exits at once; init reaps it
		os.Exit(3)
	}
}
