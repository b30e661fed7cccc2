// Command hello is the workload of IMP's guest tests. It prints what imp-init gave it and
// writes a file in its working directory; then, by its first argument:
//
//	exit    leaves an orphan for PID 1 to reap and exits with code 3
//	serve   prints a line a second until SIGTERM, then exits 0; echoes TCP on 127.0.0.1:7001;
//	        answers each line of its stdin (the console, with the ImpVM's stdin) with
//	        "hello: console said LINE"
//
// As a command run in a guest (exec), without the greeting:
//
//	tool-true         exits 0
//	tool-exit N WORDS prints WORDS on stdout, "to stderr" on stderr, and exits N
//	tool-cat          copies stdin to stdout
//	tool-tty          prints "tty COLSxROWS" when its stdin is a terminal, else "no tty"
//	tool-touch PATH   creates PATH; tool-rm PATH removes it
//	tool-absent PATH  exits 0 when PATH does not exist, else 1 (a probe's command)
//	tool-env NAME     prints $NAME (as the run's configuration stands: exec gets it)
//	tool-read PATH    prints the file at PATH
//	tool-mode PATH    prints the permission bits of PATH in octal
//	tool-write PATH S [OFF] writes S at OFF (default 0) of PATH (a file, created, or a device), synced
//	tool-head PATH N  prints the first N bytes of PATH
//	tool-io PATH MIB [direct]  measures PATH (a block device or a file of at least MIB MiB):
//	                  sequential write and read of MIB MiB in 1 MiB requests, then 4 KiB random
//	                  writes and reads for 3 s each; the caches dropped before each read; prints
//	                  "seqwrite MB/s seqread MB/s randwrite IOPS randread IOPS". With direct,
//	                  through O_DIRECT (no page cache; aligned buffers)
//	tool-dial ADDR    prints what a TCP connection to ADDR first says
//	tool-ifaces       prints each non-loopback interface: "NAME MAC ADDR/BITS..."
//	memcycle MIB S  takes MIB MiB of memory, holds it S seconds, gives it back, waits S seconds, again
//	dirty MIB RATE  serve's tick a second, and dirties a buffer of MIB MiB as it runs: RATE
//	        MiB a second of its pages written, one byte a page, page after page (a busy guest
//	        for migration benchmarks: the rate it keeps is what its vCPU's time allows)
//	counter counts in memory, one every 100 ms from 0, until SIGTERM; serves TCP on :7000
//	        ("count N host H": the count and the host name as they are when asked), and on
//	        :7002 the same line for each line a connection sends, on that connection
//	hold ADDR holds one TCP connection to ADDR (a counter's :7002) open, asking on it twice a
//	        second and printing each answer, "hold: LOCAL ANSWER" (its own end's address, so
//	        that a reader sees the connection is the same one); "hold: broken: ERR" once it
//	        breaks (a minute without an answer breaks it), after which it asks no more
//	web     serves HTTP until SIGTERM on :8080 (GET / answers "hello from <host name>", GET
//	        /healthz 200, or 503 while /dev/imp-unready exists) and on :8081 ("undeclared")
//	entropy prints a line every 50 ms until SIGTERM: "draw N who=main at=T host=H boot=B kernel=K
//	        user=U", its count, the clock (Unix nanoseconds), the host name as it is then, the
//	        kernel's boot id as read at the start, 8 bytes of the kernel's generator drawn then
//	        (getrandom), and the next value of a user-space generator seeded at the start; and
//	        starts two children that do the same (who=sibling, who=root), moved out of its
//	        cgroup: into a cgroup of their own beside it, as a container engine would, and into
//	        the root cgroup
//	stubborn prints a line a second and ignores SIGTERM
//	net     answers stdin as serve does; serves TCP on :7000 (greeting "hello from <host name>") and probes the targets
//	        of $PROBE (comma-separated icmp:A.B.C.D[-N], tcp:HOST:PORT and who:HOST:PORT,
//	        which reads another guest's greeting) twice a second, printing each change
//	        "probe <target> ok|ok <greeter>|fail", and a tick a second, until SIGTERM
package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/testguest/reach"
)

func main() {
	if len(os.Args) > 1 && strings.HasPrefix(os.Args[1], "tool-") {
		os.Exit(tool(os.Args[1], os.Args[2:]))
	}
	host, _ := os.Hostname()
	wd, _ := os.Getwd()
	fmt.Printf("hello from imp: GREETING=%s host=%s pid=%d uid=%d wd=%s\n", os.Getenv("GREETING"), host, os.Getpid(), os.Getuid(), wd)
	if prev, err := os.ReadFile("written-by-guest"); err == nil {
		fmt.Printf("hello: found an earlier write: %s", prev)
	} else {
		fmt.Println("hello: no earlier write")
	}
	if err := writeSynced("written-by-guest", "upper layer of "+host+"\n"); err != nil {
		fmt.Println("write failed:", err)
	}
	mode := "exit"
	if len(os.Args) > 1 {
		mode = os.Args[1]
	}
	switch mode {
	case "serve":
		go echoTCP("127.0.0.1:7001")
		go answerStdin()
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
	case "web":
		term := make(chan os.Signal, 1)
		signal.Notify(term, syscall.SIGTERM)
		go serveWeb(":8080", host)
		go serveWeb(":8081", "")
		<-term
		fmt.Println("hello: terminating")
		os.Exit(0)
	case "entropy":
		for who, cgroup := range map[string]string{"sibling": "/sys/fs/cgroup/hello-own", "root": "/sys/fs/cgroup"} {
			_ = os.Mkdir(cgroup, 0o755)
			child := exec.Command("/bin/hello", "entropy-child", who)
			child.Stdout, child.Stderr = os.Stdout, os.Stderr
			if err := child.Start(); err != nil {
				fmt.Println("hello: starting a child:", err)
				continue
			}
			if err := os.WriteFile(cgroup+"/cgroup.procs", []byte(strconv.Itoa(child.Process.Pid)), 0); err != nil {
				fmt.Println("hello: moving a child:", err)
			}
		}
		draws("main")
	case "entropy-child":
		draws(os.Args[2])
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
		go serveUDP(host)
		go probeLoop(os.Getenv("PROBE"))
		go answerStdin()
		go func() {
			for i := 0; ; i++ {
				time.Sleep(time.Second)
				fmt.Printf("hello: tick %d\n", i)
			}
		}()
		<-term
		fmt.Println("hello: terminating")
		os.Exit(0)
	case "memcycle":
		// Takes MiB of memory (anonymous, every page touched), holds it seconds, gives it back
		// to the guest's kernel, waits as long, and again: a guest's memory that rises and falls.
		mib, _ := strconv.Atoi(arg(2))
		secs, _ := strconv.Atoi(arg(3))
		for {
			b, err := unix.Mmap(-1, 0, max(mib, 1)<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
			if err != nil {
				fmt.Println("hello: mmap:", err)
				os.Exit(1)
			}
			for i := 0; i < len(b); i += 4096 {
				b[i] = 1
			}
			fmt.Printf("hello: holding %d MiB\n", mib)
			time.Sleep(time.Duration(max(secs, 1)) * time.Second)
			_ = unix.Munmap(b)
			fmt.Println("hello: freed")
			time.Sleep(time.Duration(max(secs, 1)) * time.Second)
		}
	case "dirty":
		mib, _ := strconv.Atoi(arg(2))
		rate, _ := strconv.Atoi(arg(3))
		go func() {
			for i := 0; ; i++ {
				time.Sleep(time.Second)
				fmt.Printf("hello: tick %d\n", i)
			}
		}()
		dirty(max(mib, 1)<<20, max(rate, 1)<<20)
	case "counter":
		var n atomic.Int64
		go func() {
			for range time.Tick(100 * time.Millisecond) {
				n.Add(1)
			}
		}()
		go serveCount(&n)
		go serveCountLines(&n)
		term := make(chan os.Signal, 1)
		signal.Notify(term, syscall.SIGTERM)
		<-term
		fmt.Println("hello: terminating")
		os.Exit(0)
	case "hold":
		hold(arg(2))
	case "child":
		return
	default:
		_ = exec.Command("/bin/hello", "child").Start() // exits at once; init reaps it
		os.Exit(3)
	}
}

// draws is the entropy workload of who: a line every 50 ms until SIGTERM.
func draws(who string) {
	boot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	var seed [32]byte
	_, _ = unix.Getrandom(seed[:], 0)
	user := mrand.New(mrand.NewChaCha8(seed))
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	for i := 0; ; i++ {
		select {
		case <-term:
			fmt.Println("hello: terminating")
			os.Exit(0)
		case <-time.After(50 * time.Millisecond):
		}
		var k [8]byte
		_, _ = unix.Getrandom(k[:], 0)
		host, _ := os.Hostname()
		fmt.Printf("draw %d who=%s at=%d host=%s boot=%s kernel=%x user=%016x\n", i, who, time.Now().UnixNano(), host, strings.TrimSpace(string(boot)), k, user.Uint64())
	}
}

// writeSynced writes s to the file at path, on the disk before it returns (a VMM killed after
// it loses none of it).
func writeSynced(path, s string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(s); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// answerStdin answers each line of stdin until its end.
func answerStdin() {
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		fmt.Printf("hello: console said %q\n", strings.TrimRight(sc.Text(), "\r"))
	}
}

func tool(name string, args []string) int {
	switch name {
	case "tool-true":
		return 0
	case "tool-exit":
		code, _ := strconv.Atoi(args[0])
		fmt.Println(strings.Join(args[1:], " "))
		fmt.Fprintln(os.Stderr, "to stderr")
		return code
	case "tool-cat":
		_, _ = io.Copy(os.Stdout, os.Stdin)
		return 0
	case "tool-touch":
		if err := os.WriteFile(args[0], nil, 0o644); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		return 0
	case "tool-rm":
		if err := os.Remove(args[0]); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		return 0
	case "tool-absent":
		if _, err := os.Stat(args[0]); err == nil {
			fmt.Println(args[0], "exists")
			return 1
		}
		return 0
	case "tool-env":
		fmt.Println(os.Getenv(args[0]))
		return 0
	case "tool-read":
		b, err := os.ReadFile(args[0])
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Print(string(b))
		return 0
	case "tool-mode":
		fi, err := os.Stat(args[0])
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Printf("%o\n", fi.Mode().Perm())
		return 0
	case "tool-write":
		f, err := os.OpenFile(args[0], os.O_WRONLY|os.O_CREATE, 0o644)
		if err == nil {
			off := int64(0)
			if len(args) > 2 {
				off, _ = strconv.ParseInt(args[2], 10, 64)
			}
			_, err = f.WriteAt([]byte(args[1]), off)
			err = errors.Join(err, f.Sync(), f.Close())
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		return 0
	case "tool-head":
		n, _ := strconv.Atoi(args[1])
		f, err := os.Open(args[0])
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer f.Close()
		b := make([]byte, n)
		k, _ := io.ReadFull(f, b)
		fmt.Print(string(b[:k]))
		return 0
	case "tool-io":
		mib, _ := strconv.Atoi(args[1])
		out, err := measureIO(args[0], int64(mib), len(args) > 2 && args[2] == "direct")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println(out)
		return 0
	case "tool-reach": // a reachability matrix's server, prober and watcher (package reach)
		code, _ := reach.Main(os.Stdout, args)
		return code
	case "tool-dial":
		c, err := net.DialTimeout("tcp", args[0], 3*time.Second)
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(3 * time.Second))
		line, _ := bufio.NewReader(c).ReadString('\n')
		fmt.Print(line)
		return 0
	case "tool-ifaces":
		ifs, _ := net.Interfaces()
		for _, i := range ifs {
			if i.Flags&net.FlagLoopback != 0 {
				continue
			}
			addrs, _ := i.Addrs()
			fmt.Print(i.Name, " ", i.HardwareAddr)
			for _, a := range addrs {
				fmt.Print(" ", a)
			}
			fmt.Println()
		}
		return 0
	case "tool-tty":
		ws, err := unix.IoctlGetWinsize(0, unix.TIOCGWINSZ)
		if err != nil {
			fmt.Println("no tty")
			return 0
		}
		fmt.Printf("tty %dx%d\n", ws.Col, ws.Row)
		return 0
	}
	fmt.Fprintln(os.Stderr, "unknown tool", name)
	return 127
}

// serveCount answers each connection on :7000 with the count and the host name as they are.
func serveCount(n *atomic.Int64) {
	l, err := net.Listen("tcp", ":7000")
	if err != nil {
		fmt.Println("hello: count:", err)
		return
	}
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		host, _ := os.Hostname()
		fmt.Fprintf(c, "count %d host %s\n", n.Load(), host)
		c.Close()
	}
}

// serveCountLines answers each line a connection to :7002 sends with the count and the host
// name, on that connection, until the client closes it.
func serveCountLines(n *atomic.Int64) {
	l, err := net.Listen("tcp", ":7002")
	if err != nil {
		fmt.Println("hello: count lines:", err)
		return
	}
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			sc := bufio.NewScanner(c)
			for sc.Scan() {
				host, _ := os.Hostname()
				if _, err := fmt.Fprintf(c, "count %d host %s\n", n.Load(), host); err != nil {
					return
				}
			}
		}()
	}
}

// hold is the hold workload: one connection to addr, asked twice a second for as long as it
// answers (dialled again until it is first made).
func hold(addr string) {
	var c net.Conn
	for {
		var err error
		if c, err = net.DialTimeout("tcp", addr, 2*time.Second); err == nil {
			break
		}
		fmt.Println("hold: dial:", err)
		time.Sleep(time.Second)
	}
	fmt.Printf("hold: connected from %s\n", c.LocalAddr())
	r := bufio.NewReader(c)
	for {
		time.Sleep(500 * time.Millisecond)
		_ = c.SetDeadline(time.Now().Add(time.Minute))
		line, err := "", error(nil)
		if _, err = fmt.Fprintln(c, "ask"); err == nil {
			line, err = r.ReadString('\n')
		}
		if err != nil {
			fmt.Println("hold: broken:", err)
			select {}
		}
		fmt.Printf("hold: %s %s", c.LocalAddr(), line)
	}
}

// echoTCP echoes every connection to addr.
func echoTCP(addr string) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Println("hello: echo:", err)
		return
	}
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() { _, _ = io.Copy(c, c); c.Close() }()
	}
}

// serveWeb serves HTTP on addr: the greeting of host at / and the health at /healthz (host
// empty: "undeclared" everywhere).
func serveWeb(addr, host string) {
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if host == "" {
			fmt.Fprintln(w, "undeclared")
			return
		}
		fmt.Fprintf(w, "hello from %s\n", host)
	})
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		if _, err := os.Stat("/dev/imp-unready"); err == nil {
			http.Error(w, "unready", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	if err := http.ListenAndServe(addr, mux); err != nil {
		fmt.Println("hello: web:", err)
	}
}

// measureIO is tool-io.
func measureIO(path string, mib int64, direct bool) (string, error) {
	flag := os.O_RDWR
	if direct {
		flag |= unix.O_DIRECT
	}
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		return "", err
	}
	defer f.Close()
	drop := func() {
		_ = f.Sync()
		_ = unix.IoctlSetInt(int(f.Fd()), unix.BLKFLSBUF, 0)    // a block device's buffer cache
		_ = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED) // a file's page cache
	}
	// Page-aligned, as O_DIRECT wants its buffers.
	buf, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return "", err
	}
	defer unix.Munmap(buf)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	start := time.Now()
	for i := int64(0); i < mib; i++ {
		if _, err := f.WriteAt(buf, i<<20); err != nil {
			return "", err
		}
	}
	if err := f.Sync(); err != nil {
		return "", err
	}
	seqW := float64(mib) / time.Since(start).Seconds()
	drop()
	start = time.Now()
	for i := int64(0); i < mib; i++ {
		if _, err := f.ReadAt(buf, i<<20); err != nil {
			return "", err
		}
	}
	seqR := float64(mib) / time.Since(start).Seconds()
	blocks := mib << 8 // 4 KiB blocks
	page := buf[:4096]
	x := uint64(88172645463325252)
	next := func() int64 { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return int64(x%uint64(blocks)) << 12 }
	n, start := 0, time.Now()
	for time.Since(start) < 3*time.Second {
		if _, err := f.WriteAt(page, next()); err != nil {
			return "", err
		}
		if err := f.Sync(); err != nil { // each write reaches the device
			return "", err
		}
		n++
	}
	randW := float64(n) / time.Since(start).Seconds()
	drop()
	n, start = 0, time.Now()
	for time.Since(start) < 3*time.Second {
		if _, err := f.ReadAt(page, next()); err != nil {
			return "", err
		}
		n++
	}
	randR := float64(n) / time.Since(start).Seconds()
	return fmt.Sprintf("seqwrite %.1f seqread %.1f randwrite %.0f randread %.0f", seqW, seqR, randW, randR), nil
}

// arg is the program's argument i, "" when there is none.
func arg(i int) string {
	if len(os.Args) > i {
		return os.Args[i]
	}
	return ""
}

// dirty writes one byte in each page of a buffer of size bytes, page after page and round
// again, rate bytes of pages a second, paced every 10 ms; for ever.
func dirty(size, rate int) {
	const page = 4096
	buf := make([]byte, size)
	perTick := max(rate/100/page, 1)
	p, n := 0, byte(0)
	for tick := time.NewTicker(10 * time.Millisecond); ; <-tick.C {
		for range perTick {
			buf[p] = n
			if p += page; p >= len(buf) {
				p, n = 0, n+1
			}
		}
	}
}
