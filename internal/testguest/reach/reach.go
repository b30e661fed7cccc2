// Package reach is what a reachability matrix needs of each of its sources and destinations
// (pods and guests alike): a server that answers with its name on TCP and UDP, a prober that
// tries many destinations at once and says which answered, and a watcher that probes one
// destination without pause and says when the answer changes.
package reach

import (
	"bufio"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Serve answers on every port, over TCP (a line with name) and UDP (a datagram with name).
// It returns only when a port cannot be listened on.
func Serve(name string, ports ...int) error {
	errc := make(chan error, 2*len(ports))
	for _, p := range ports {
		l, err := net.Listen("tcp", ":"+strconv.Itoa(p))
		if err != nil {
			return err
		}
		u, err := net.ListenPacket("udp", ":"+strconv.Itoa(p))
		if err != nil {
			return err
		}
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					errc <- err
					return
				}
				fmt.Fprintln(c, name)
				c.Close()
			}
		}()
		go func() {
			buf := make([]byte, 64)
			for {
				_, from, err := u.ReadFrom(buf)
				if err != nil {
					errc <- err
					return
				}
				_, _ = u.WriteTo([]byte(name+"\n"), from)
			}
		}()
	}
	return <-errc
}

// Try asks target ("tcp:host:port" or "udp:host:port") once, within timeout, and returns the
// name that answered, or an error.
func Try(target string, timeout time.Duration) (string, error) {
	proto, addr, ok := strings.Cut(target, ":")
	if !ok || (proto != "tcp" && proto != "udp") {
		return "", fmt.Errorf("target %q: want tcp:HOST:PORT or udp:HOST:PORT", target)
	}
	c, err := net.DialTimeout(proto, addr, timeout)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	if proto == "udp" {
		if _, err := c.Write([]byte("who\n")); err != nil {
			return "", err
		}
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(line), nil
}

// Probe tries every target at once and writes, in the order given, "TARGET NAME" for each
// that answered and "TARGET -" for each that did not.
func Probe(w io.Writer, timeout time.Duration, targets []string) {
	got := make([]string, len(targets))
	var wg sync.WaitGroup
	for i, t := range targets {
		wg.Go(func() {
			name, err := Try(t, timeout)
			if err != nil || name == "" {
				name = "-"
			}
			got[i] = name
		})
	}
	wg.Wait()
	for i, t := range targets {
		fmt.Fprintln(w, t, got[i])
	}
}

// watchTimeout bounds each of Watch's probes.
const watchTimeout = 2 * time.Second

// Watch tries target every interval for d (each try bounded by watchTimeout, or interval if
// longer) and writes "UNIXNANO ok|fail" for the first try and each try whose outcome differs
// from the one before: when a change of policy took effect, as the source saw it.
func Watch(w io.Writer, target string, interval, d time.Duration) {
	last := ""
	for end := time.Now().Add(d); time.Now().Before(end); {
		began := time.Now()
		// Each probe may take up to watchTimeout: a guest under TCG on a busy machine can take
		// longer than the interval to answer, which is no refusal.
		_, err := Try(target, max(interval, watchTimeout))
		state := "ok"
		if err != nil {
			state = "fail"
		}
		if state != last {
			fmt.Fprintln(w, began.UnixNano(), state)
			last = state
		}
		if rest := interval - time.Since(began); rest > 0 {
			time.Sleep(rest)
		}
	}
}

// Get sends one GET for host to dial ("host:port"), over TLS with host as the server name
// when useTLS (any certificate), and returns the answer's first line, "reset" when the
// connection was reset, or "error: ...".
func Get(host, dial string, useTLS bool, timeout time.Duration) string {
	c, err := net.DialTimeout("tcp", dial, timeout)
	if err == nil {
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(timeout))
		if useTLS {
			tc := tls.Client(c, &tls.Config{ServerName: host, InsecureSkipVerify: true}) //nolint:gosec // a probe, of the test's own servers
			err = tc.Handshake()
			c = tc
		}
	}
	var resp *http.Response
	if err == nil {
		if _, err = fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", host); err == nil {
			resp, err = http.ReadResponse(bufio.NewReader(c), nil)
		}
	}
	switch {
	case errors.Is(err, syscall.ECONNRESET):
		return "reset"
	case err != nil:
		return "error: " + err.Error()
	}
	defer resp.Body.Close()
	line, _ := bufio.NewReader(resp.Body).ReadString('\n')
	return strings.TrimSpace(line)
}

// Main runs the tool of args for a program that carries it: "serve NAME PORT...", "probe
// TIMEOUT TARGET...", "watch TARGET INTERVAL DURATION", "get [--tls] HOST DIAL". It returns
// the exit code, and false when args name none of them.
func Main(w io.Writer, args []string) (int, bool) {
	if len(args) == 0 {
		return 0, false
	}
	switch args[0] {
	case "serve":
		var ports []int
		for _, a := range args[2:] {
			p, err := strconv.Atoi(a)
			if err != nil {
				fmt.Fprintln(w, "port:", err)
				return 2, true
			}
			ports = append(ports, p)
		}
		if len(args) < 3 {
			fmt.Fprintln(w, "usage: serve NAME PORT...")
			return 2, true
		}
		fmt.Fprintln(w, Serve(args[1], ports...))
		return 1, true
	case "probe":
		d, err := time.ParseDuration(args[min(1, len(args)-1)])
		if err != nil || len(args) < 2 {
			fmt.Fprintln(w, "usage: probe TIMEOUT TARGET...")
			return 2, true
		}
		Probe(w, d, args[2:])
		return 0, true
	case "get":
		rest, useTLS := args[1:], false
		if len(rest) > 0 && rest[0] == "--tls" {
			rest, useTLS = rest[1:], true
		}
		if len(rest) != 2 {
			fmt.Fprintln(w, "usage: get [--tls] HOST DIAL")
			return 2, true
		}
		fmt.Fprintln(w, Get(rest[0], rest[1], useTLS, 5*time.Second))
		return 0, true
	case "watch":
		if len(args) != 4 {
			fmt.Fprintln(w, "usage: watch TARGET INTERVAL DURATION")
			return 2, true
		}
		i, err1 := time.ParseDuration(args[2])
		d, err2 := time.ParseDuration(args[3])
		if err1 != nil || err2 != nil {
			fmt.Fprintln(w, "usage: watch TARGET INTERVAL DURATION")
			return 2, true
		}
		Watch(w, args[1], i, d)
		return 0, true
	}
	return 0, false
}
