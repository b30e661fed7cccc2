package e2e

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/creack/pty"
	"github.com/syscode-labs/imp/internal/guestsession/guesttest"
)

// checkKubectlImp drives kubectl imp as a user runs it, through the API server, the operator
// and the node's agent, against the sample VM hello (its console is its workload's terminal)
// and a VM with no network, both real guests on the real node: exec with output and exit code,
// exec -it and the console in terminals, logs -f, port-forward.
func checkKubectlImp(t *testing.T, env []string, dir, image, node, vmmKind string) {
	t.Helper()
	imp := func(args ...string) *exec.Cmd {
		c := exec.Command("kubectl", append([]string{"imp", "-n", "demo"}, args...)...)
		c.Env, c.Dir = env, dir
		return c
	}

	// The node's agent serves with a certificate of its own node, which it asked for and the
	// operator signed.
	get := exec.Command("kubectl", "get", "csr", "--field-selector", "spec.signerName=imp.dev/agent-access")
	get.Env, get.Dir = env, dir
	csrs, err := get.CombinedOutput()
	if err != nil || !strings.Contains(string(csrs), "imp-agent-"+node+"-") || !strings.Contains(string(csrs), "Approved,Issued") {
		t.Errorf("the agent's certificate request: %v\n%s", err, csrs)
	}
	t.Logf("$ kubectl get csr --field-selector spec.signerName=imp.dev/agent-access\n%s", csrs)

	// exec: the guest's stdout and stderr, and its exit code.
	var out, errOut bytes.Buffer
	c := imp("exec", "hello", "--", "/bin/hello", "tool-exit", "3", "from", "the", "guest")
	c.Stdout, c.Stderr = &out, &errOut
	err = c.Run()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 3 || out.String() != "from the guest\n" || !strings.Contains(errOut.String(), "to stderr") {
		t.Errorf("kubectl imp exec: stdout %q, stderr %q, %v; want the words, to stderr, exit code 3", out.String(), errOut.String(), err)
	}
	t.Logf("kubectl imp exec hello -- /bin/hello tool-exit 3 ...: stdout %q, stderr %q, exit code 3", out.String(), errOut.String())

	// exec -it: a terminal of 40 rows and 100 columns.
	term := &guesttest.Screen{}
	c = imp("exec", "-it", "hello", "--", "/bin/hello", "tool-tty")
	ptmx, err := pty.StartWithSize(c, &pty.Winsize{Rows: 40, Cols: 100})
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(term, ptmx) // until the command ends
	ptmx.Close()
	if err := c.Wait(); err != nil || !strings.Contains(term.String(), "tty 100x40") {
		t.Errorf("kubectl imp exec -it: %q, %v; want the terminal's size 100x40", term.String(), err)
	}
	t.Logf("kubectl imp exec -it hello -- /bin/hello tool-tty, in a terminal of 100x40: %q", term.String())

	// console: the log's end, a line typed that the workload answers, Ctrl-] detaching.
	term = &guesttest.Screen{}
	c = imp("console", "hello")
	ptmx, err = pty.StartWithSize(c, &pty.Winsize{Rows: 40, Cols: 100})
	if err != nil {
		t.Fatal(err)
	}
	defer ptmx.Close()
	copied := make(chan struct{})
	go func() { _, _ = io.Copy(term, ptmx); close(copied) }()
	term.WaitFor(t, "hello from imp", time.Minute)
	if _, err := ptmx.Write([]byte("ping\r")); err != nil {
		t.Fatal(err)
	}
	term.WaitFor(t, `hello: console said "ping"`, time.Minute)
	if _, err := ptmx.Write([]byte{0x1d}); err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() { waited <- c.Wait() }()
	select {
	case err := <-waited:
		if err != nil {
			t.Errorf("kubectl imp console ended with %v", err)
		}
	case <-time.After(time.Minute):
		_ = c.Process.Kill()
		t.Error("kubectl imp console did not detach on Ctrl-]")
	}
	t.Logf("kubectl imp console hello: the greeting, the echo of ping, the workload's answer; Ctrl-] detached")

	// logs -f: a tick written after it started.
	logs := imp("logs", "hello", "-f")
	followed := &guesttest.Screen{}
	logs.Stdout = followed
	if err := logs.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = logs.Process.Kill(); _ = logs.Wait() }()
	tick := regexp.MustCompile(`hello: tick (\d+)`)
	followed.WaitForMatch(t, tick, time.Minute)
	ticks := tick.FindAllStringSubmatch(followed.String(), -1)
	last, _ := strconv.Atoi(ticks[len(ticks)-1][1])
	followed.WaitForMatch(t, regexp.MustCompile(fmt.Sprintf(`hello: tick %d\b`, last+2)), time.Minute)

	// port-forward to a TCP server on the loopback of a VM with no network.
	vmm := ""
	if vmmKind != "" {
		vmm = "\n  vmm: " + vmmKind
	}
	apply := exec.Command("kubectl", "apply", "-f", "-")
	apply.Env, apply.Dir = env, dir
	apply.Stdin = strings.NewReader(fmt.Sprintf(`apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata: {name: loner, namespace: demo}
spec:
  image: %s
  command: [/bin/hello]
  args: [serve]
  resources: {vcpus: 1, memory: 256Mi}
  nodeSelector: {imp.test/node: %s}
  terminationGracePeriodSeconds: 5%s
`, image, node, vmm))
	if b, err := apply.CombinedOutput(); err != nil {
		t.Fatalf("creating the VM loner: %v\n%s", err, b)
	}
	kubectl := func(args ...string) {
		t.Helper()
		c := exec.Command("kubectl", args...)
		c.Env, c.Dir = env, dir
		if b, err := c.CombinedOutput(); err != nil {
			t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, b)
		}
	}
	kubectl("-n", "demo", "wait", "--for=condition=Ready", "impvm/loner", "--timeout=5m")
	// The workload listens on 7001 a moment after the guest says it is ready, and ticks each
	// second after that. A forwarded connection the guest refuses ends kubectl port-forward
	// itself (kubectl: "lost connection to pod"), so wait for the first tick.
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Second) {
		out, _ := imp("logs", "loner").CombinedOutput()
		if strings.Contains(string(out), "hello: tick") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("loner's workload never ticked:\n%s", out)
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	fwd := imp("port-forward", "loner", fmt.Sprintf("%d:7001", port))
	forwarding := &guesttest.Screen{}
	fwd.Stdout, fwd.Stderr = forwarding, forwarding
	if err := fwd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = fwd.Process.Kill(); _ = fwd.Wait() }()
	forwarding.WaitFor(t, "Forwarding from", time.Minute)
	echo := func(msg []byte) error {
		conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			return err
		}
		defer conn.Close()
		go func() { _, _ = conn.Write(msg) }()
		got := make([]byte, len(msg))
		_ = conn.SetReadDeadline(time.Now().Add(2 * time.Minute))
		if _, err := io.ReadFull(conn, got); err != nil {
			return err
		}
		if !bytes.Equal(got, msg) {
			return errors.New("echoed something else")
		}
		return nil
	}
	start, tries := time.Now(), 0
	for {
		tries++
		err := echo([]byte("ping"))
		if err == nil {
			break
		}
		if time.Since(start) > time.Minute {
			t.Fatalf("the guest's echo server never answered through kubectl imp port-forward: %d tries in %v, the last: %v\n%s",
				tries, time.Since(start).Round(time.Second), err, forwarding.String())
		}
		time.Sleep(time.Second)
	}
	t.Logf("the guest's echo server answered through kubectl imp port-forward after %d tries, %v", tries, time.Since(start).Round(time.Millisecond))
	msg := bytes.Repeat([]byte("to the guest's loopback "), 40000) // ~1 MB
	if err := echo(msg); err != nil {
		t.Errorf("echo through kubectl imp port-forward to loner's 127.0.0.1:7001: %v", err)
	} else {
		t.Logf("kubectl imp port-forward loner %d:7001: %d bytes echoed by a VM with no network", port, len(msg))
	}
	_ = fwd.Process.Kill()
	kubectl("-n", "demo", "delete", "impvm", "loner", "--wait=true", "--timeout=3m")
}
