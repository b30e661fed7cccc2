package fctest

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
)

// FakeJailer stands in for Firecracker's jailer and the Firecracker it execs, for tests on
// machines without KVM. Like the jailer it takes the jailer's arguments and finds the jail;
// like Firecracker it serves the API — the strict double — on the jail's API socket; and like
// a guest running imp-init it answers on the vsock guest channel once the VM is started (hello
// with the token from the boot arguments, then ready) and, on Ctrl-Alt-Del, reports exit code
// 0 and exits. With IMP_FAKE_JAILER_IGNORE_CAD set it ignores Ctrl-Alt-Del. Its serial console
// answers each line of its stdin, as Firecracker's passes stdin to a guest that echoes, with
// "console said LINE" in the serial output file; --daemonize makes stdin /dev/null, as the
// jailer's does. It returns the process's exit code.
func FakeJailer(args []string) int {
	if len(args) == 1 && args[0] == "--version" {
		fmt.Println("Jailer v1.16.1")
		return 0
	}
	fs := flag.NewFlagSet("jailer", flag.ContinueOnError)
	id := fs.String("id", "", "")
	exec := fs.String("exec-file", "", "")
	base := fs.String("chroot-base-dir", "/srv/jailer", "")
	fs.Int("uid", -1, "")
	fs.Int("gid", -1, "")
	fs.String("cgroup-version", "1", "")
	fs.String("parent-cgroup", "", "")
	fs.String("netns", "", "")
	daemonize := fs.Bool("daemonize", false, "")
	fs.Func("cgroup", "", func(string) error { return nil })
	if err := fs.Parse(args); err != nil {
		return 2
	}
	rest := fs.Args()
	if *id == "" || *exec == "" || len(rest) != 2 || rest[0] != "--api-sock" {
		fmt.Fprintln(os.Stderr, "fake jailer: bad arguments", args)
		return 2
	}
	root := filepath.Join(*base, filepath.Base(*exec), *id, "root")
	srv, err := Serve(filepath.Join(root, rest[1]))
	if err != nil {
		fmt.Fprintln(os.Stderr, "fake jailer:", err)
		return 1
	}
	srv.Root = root
	done := make(chan struct{})
	guest := &fakeGuest{}
	stdin := os.Stdin
	if *daemonize {
		stdin, _ = os.Open(os.DevNull)
	}
	srv.OnStart = func(cfg Config) {
		if p, _ := cfg.Vsock["uds_path"].(string); p != "" {
			guest.start(filepath.Join(root, p), cfg)
		}
		if p, _ := cfg.Serial["serial_out_path"].(string); p != "" {
			go echoConsole(stdin, filepath.Join(root, p))
		}
	}
	if os.Getenv("IMP_FAKE_JAILER_IGNORE_CAD") == "" {
		srv.OnCtrlAltDel = func() {
			guest.send(map[string]any{"event": "exit", "code": 0})
			close(done)
		}
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM)
	select {
	case <-done:
	case <-sigs:
	}
	return 0
}

// echoConsole answers each line of in with "console said LINE" in the file out.
func echoConsole(in *os.File, out string) {
	f, err := os.OpenFile(out, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return
	}
	defer f.Close()
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		fmt.Fprintf(f, "console said %q\n", strings.TrimRight(sc.Text(), "\r"))
	}
}

// fakeGuest is the guest end of the vsock channel, as imp-init serves it.
type fakeGuest struct {
	history [][]byte
	conn    net.Conn
}

func (g *fakeGuest) send(m map[string]any) {
	line, _ := json.Marshal(m)
	line = append(line, '\n')
	g.history = append(g.history, line)
	if g.conn != nil {
		_, _ = g.conn.Write(line)
	}
}

func (g *fakeGuest) start(sock string, cfg Config) {
	token := ""
	args, _ := cfg.BootSource["boot_args"].(string)
	for _, f := range strings.Fields(args) {
		if v, ok := strings.CutPrefix(f, "imp.token="); ok {
			token = v
		}
	}
	ln, err := listenLong(sock)
	if err != nil {
		return
	}
	g.send(map[string]any{"event": "hello", "token": token})
	g.send(map[string]any{"event": "ready"})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			line, err := bufio.NewReader(c).ReadString('\n')
			if err != nil || !strings.HasPrefix(line, "CONNECT ") {
				c.Close()
				continue
			}
			fmt.Fprintf(c, "OK 1073741824\n")
			g.conn = c
			for _, l := range g.history {
				_, _ = c.Write(l)
			}
		}
	}()
}
