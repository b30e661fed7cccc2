package fctest

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"

	"github.com/syscode-labs/imp/internal/guestinit"
)

// FakeFirecracker stands in for the Firecracker that FakeJailer execs in the jail, for tests
// on machines without KVM. It takes the arguments the jailer passes; like Firecracker it serves
// the API — the strict double — on --api-sock, its paths those of the jail it runs in; and like
// a guest running imp-init it answers on the vsock guest channel once the VM is started (hello
// with the token from the boot arguments, then ready) and, on Ctrl-Alt-Del, reports exit code
// 0 and exits. With IMP_FAKE_JAILER_IGNORE_CAD set it ignores Ctrl-Alt-Del. Its serial console
// answers each line of its stdin, as Firecracker's passes stdin to a guest that echoes, with
// "console said LINE" in the serial output file. It returns the process's exit code.
func FakeFirecracker(args []string) int {
	fs := flag.NewFlagSet("firecracker", flag.ContinueOnError)
	id := fs.String("id", "", "")
	apiSock := fs.String("api-sock", "/run/firecracker.socket", "")
	fs.String("start-time-us", "", "")
	fs.String("start-time-cpu-us", "", "")
	fs.String("parent-cpu-time-us", "", "")
	if err := fs.Parse(args); err != nil || *id == "" || fs.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "fake firecracker: bad arguments", args)
		return 2
	}
	srv, err := Serve(*apiSock)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fake firecracker:", err)
		return 1
	}
	srv.Root = "/"
	done := make(chan struct{})
	guest := &fakeGuest{}
	srv.GuestFrozen = guest.isFrozen
	srv.OnStart = func(cfg Config) {
		findVolumes(cfg, srv.drives)
		// What the jail's /disks holds as the guest starts, for tests of what a guest's
		// VMM can reach.
		if es, err := os.ReadDir("/disks"); err == nil {
			var names []string
			for _, e := range es {
				names = append(names, e.Name())
			}
			_ = os.WriteFile("/"+GuestDisksFile, []byte(strings.Join(names, "\n")), 0o600)
		}
		if p, _ := cfg.Vsock["uds_path"].(string); p != "" && os.Getenv(StuckGuestEnv) == "" {
			guest.start(p, cfg)
		}
		if p, _ := cfg.Serial["serial_out_path"].(string); p != "" {
			go echoConsole(os.Stdin, p)
		}
	}
	srv.ExitOnCtrlAltDel = os.Getenv("IMP_FAKE_JAILER_CAD_EXIT") != ""
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

// findVolumes finds, as imp-init does, the block device of each disk volume that the run's
// configuration disk names by serial, reading each drive's serial as Firecracker answers
// VIRTIO_BLK_T_GET_ID (the file's st_dev, st_rdev and st_ino in decimal, cut to 20 bytes), and
// writes what it found in /guest-volumes.json: volume name → drive id ("" when none).
func findVolumes(cfg Config, open map[string]*os.File) {
	serials := map[string]string{} // serial → drive id
	var config string
	for id, d := range cfg.Drives {
		p, _ := d["path_on_host"].(string)
		if id == "config" {
			config = p
		}
		// Of the file the drive has open, as Firecracker's build_device_id: its path may be
		// gone from the jail by now.
		var st syscall.Stat_t
		f := open[id]
		if f == nil || syscall.Fstat(int(f.Fd()), &st) != nil {
			continue
		}
		serial := fmt.Sprintf("%d%d%d", st.Dev, st.Rdev, st.Ino)
		serials[serial[:min(len(serial), 20)]] = id
	}
	f, err := os.Open(config)
	if err != nil {
		return
	}
	defer f.Close()
	c, err := guestinit.DecodeConfigDisk(f)
	if err != nil || len(c.Volumes) == 0 {
		return
	}
	found := map[string]string{}
	for _, v := range c.Volumes {
		if v.Serial != "" {
			found[v.Name] = serials[v.Serial]
		}
	}
	b, _ := json.Marshal(found)
	_ = os.WriteFile("/guest-volumes.json", b, 0o600)
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

// fakeGuest is the guest end of the vsock channel, as imp-init serves it: a new connection is
// told the history (its hello offers to freeze the workload); a "replay" request tells it
// again; "freeze" freezes the workload, answered "frozen", and "thaw" thaws it (the state in
// /guest-frozen, "1" or "0"); a "restore" request with the guest's token makes it take on the
// new token (its hello says it from then on), writes the request's identity to
// /guest-identity.json (the jail's root) with the interfaces the VM has and whether the
// workload was frozen (the snapshot's), thaws it, and answers "restored".
type fakeGuest struct {
	mu      sync.Mutex
	history [][]byte
	conn    net.Conn
	token   string
	ifaces  map[string]map[string]any
	frozen  bool
}

func (g *fakeGuest) isFrozen() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.frozen
}

// setFrozen records the workload's state; the caller holds g.mu.
func (g *fakeGuest) setFrozen(frozen bool) {
	g.frozen = frozen
	v := "0"
	if frozen {
		v = "1"
	}
	_ = os.WriteFile("/guest-frozen", []byte(v), 0o600)
}

func (g *fakeGuest) send(m map[string]any) {
	line, _ := json.Marshal(m)
	line = append(line, '\n')
	g.mu.Lock()
	defer g.mu.Unlock()
	if m["event"] != "restored" && m["event"] != guestinit.FrozenEvent {
		g.history = append(g.history, line)
	}
	if g.conn != nil {
		_, _ = g.conn.Write(line)
	}
}

// serve answers the requests of connection c.
func (g *fakeGuest) serve(r *bufio.Reader, c net.Conn) {
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			return
		}
		var req struct {
			Op      string         `json:"op"`
			Token   string         `json:"token"`
			Restore map[string]any `json:"restore"`
		}
		if json.Unmarshal(line, &req) != nil {
			continue
		}
		g.mu.Lock()
		ok := req.Token == g.token && g.token != ""
		g.mu.Unlock()
		switch {
		case !ok:
		case req.Op == "replay":
			g.mu.Lock()
			for _, l := range g.history {
				_, _ = c.Write(l)
			}
			g.mu.Unlock()
		case req.Op == "freeze":
			g.mu.Lock()
			g.setFrozen(true)
			g.mu.Unlock()
			g.send(map[string]any{"event": guestinit.FrozenEvent})
		case req.Op == "thaw":
			g.mu.Lock()
			g.setFrozen(false)
			g.mu.Unlock()
		case req.Op == "restore" && req.Restore != nil:
			g.mu.Lock()
			newToken, _ := req.Restore["token"].(string)
			g.token = newToken
			for i, l := range g.history {
				if strings.Contains(string(l), `"hello"`) {
					g.history[i] = []byte(`{"event":"hello","token":"` + newToken + `"}` + "\n")
				}
			}
			id, _ := json.Marshal(map[string]any{"restore": req.Restore, "interfaces": g.ifaces, "frozenAtRestore": g.frozen})
			g.setFrozen(false)
			g.mu.Unlock()
			_ = os.WriteFile("/guest-identity.json", id, 0o600)
			g.send(map[string]any{"event": "restored", "token": newToken})
		}
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
	ln, err := net.Listen("unix", sock) // checked free when the device was configured
	if err != nil {
		return
	}
	g.mu.Lock()
	g.token, g.ifaces = token, cfg.NetIfaces
	g.setFrozen(cfg.GuestFrozen) // a snapshot's guest runs on as it was taken
	g.mu.Unlock()
	g.send(map[string]any{"event": "hello", "token": token, "freezes": true})
	g.send(map[string]any{"event": "ready"})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			r := bufio.NewReader(c)
			line, err := r.ReadString('\n')
			if err != nil || !strings.HasPrefix(line, "CONNECT ") {
				c.Close()
				continue
			}
			fmt.Fprintf(c, "OK 1073741824\n")
			g.mu.Lock()
			g.conn = c
			for _, l := range g.history {
				_, _ = c.Write(l)
			}
			g.mu.Unlock()
			go g.serve(r, c)
		}
	}()
}
