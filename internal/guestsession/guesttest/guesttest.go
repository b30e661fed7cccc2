// Package guesttest serves a guest's session channel in the test's process, for tests of what
// reaches guests through it: commands run on this host, and the guest's port EchoPort is a TCP
// echo server.
package guesttest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/transport/spdy"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/guestsession"
)

// EchoPort is the guest's port that echoes.
const EchoPort = 7777

// Client is a session client of a guest served in this process until the test ends.
func Client(t testing.TB) *guestsession.Client {
	t.Helper()
	echo, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { echo.Close() })
	go func() {
		for {
			c, err := echo.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	srv := &guestsession.Server{Token: "guesttest",
		Command: func(argv []string) (*exec.Cmd, error) { return exec.Command(argv[0], argv[1:]...), nil },
		Dial: func(ctx context.Context, port int) (net.Conn, error) {
			if port != EchoPort {
				return nil, errors.New("connection refused")
			}
			var d net.Dialer
			return d.DialContext(ctx, "tcp", echo.Addr().String())
		}}
	c := guestsession.NewClient("guesttest", func(context.Context) (net.Conn, error) {
		fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		host, err := net.FileConn(os.NewFile(uintptr(fds[0]), "host"))
		if err != nil {
			return nil, err
		}
		guest, err := net.FileConn(os.NewFile(uintptr(fds[1]), "guest"))
		if err != nil {
			return nil, err
		}
		go func() { _ = srv.Serve(guest); guest.Close() }()
		return host, nil
	})
	t.Cleanup(c.Close)
	return c
}

// VMs are VMs of one node (as internal/agent/access consumes them) whose guests are all
// Client's, with a console log each in Dir.
type VMs struct {
	Guest *guestsession.Client
	Dir   string
	UIDs  map[types.NamespacedName]types.UID
}

// NewVMs are the VMs uids, with "boot\n" on each console.
func NewVMs(t testing.TB, uids map[types.NamespacedName]types.UID) *VMs {
	t.Helper()
	v := &VMs{Guest: Client(t), Dir: t.TempDir(), UIDs: uids}
	for _, uid := range uids {
		if err := os.WriteFile(v.Console(uid), []byte("boot\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return v
}

// Console is the path of uid's console log.
func (v *VMs) Console(uid types.UID) string { return filepath.Join(v.Dir, string(uid)+".log") }

var errNotHere = errors.New("the VM is not running on this node")

func (v *VMs) Session(key types.NamespacedName, uid types.UID) (*guestsession.Client, error) {
	if v.UIDs[key] != uid || uid == "" {
		return nil, errNotHere
	}
	return v.Guest, nil
}

func (v *VMs) ConsoleLog(key types.NamespacedName, uid types.UID) (*os.File, error) {
	if v.UIDs[key] != uid || uid == "" {
		return nil, errNotHere
	}
	return os.Open(v.Console(uid))
}

// Figures are the same figures for each VM (what kubectl imp top reads): its VMM at 1.5 s of
// CPU and 200 MiB on the node, its guest of 128 MiB with 100 MiB available.
func (v *VMs) Figures(key types.NamespacedName, uid types.UID) (impv1.VMFigures, error) {
	if v.UIDs[key] != uid || uid == "" {
		return impv1.VMFigures{}, errNotHere
	}
	now := metav1.NowMicro()
	return impv1.VMFigures{At: now, VMMCPUSeconds: 1.5, VMMResidentBytes: 200 << 20, DiskAllocatedBytes: 4 << 20,
		Guest: &impv1.GuestFigures{At: now, MemoryBytes: 128 << 20, MemoryAvailableBytes: 100 << 20}}, nil
}

// ConsoleInput is the console of a guest that answers each line typed with "console said
// LINE" on its console; its run never ends.
func (v *VMs) ConsoleInput(key types.NamespacedName, uid types.UID) (io.WriteCloser, <-chan struct{}, error) {
	if v.UIDs[key] != uid || uid == "" {
		return nil, nil, errNotHere
	}
	f, err := os.OpenFile(v.Console(uid), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return nil, nil, err
	}
	return &echoConsole{f: f}, make(chan struct{}), nil
}

// echoConsole answers lines written to it on a console log.
type echoConsole struct {
	f    *os.File
	line []byte
}

func (c *echoConsole) Write(p []byte) (int, error) {
	for _, b := range p {
		if b != '\r' && b != '\n' {
			c.line = append(c.line, b)
			continue
		}
		if _, err := fmt.Fprintf(c.f, "console said %q\n", c.line); err != nil {
			return 0, err
		}
		c.line = c.line[:0]
	}
	return len(p), nil
}

func (c *echoConsole) Close() error { return c.f.Close() }

// PortForward forwards a local port to remote through the portforward subresource at u, as
// kubectl port-forward does (SPDY), and returns a connection to it and a function that ends
// the forward (and returns once it has); both end with the test too.
func PortForward(t testing.TB, cfg *rest.Config, u *url.URL, remote int) (net.Conn, func()) {
	t.Helper()
	rt, upgrader, err := spdy.RoundTripperFor(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop, ready := make(chan struct{}), make(chan struct{})
	fw, err := portforward.NewOnAddresses(spdy.NewDialer(upgrader, &http.Client{Transport: rt}, http.MethodPost, u),
		[]string{"127.0.0.1"}, []string{"0:" + strconv.Itoa(remote)}, stop, ready, io.Discard, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 1)
	go func() { errs <- fw.ForwardPorts() }()
	var once sync.Once
	end := func() { once.Do(func() { close(stop); <-errs }) }
	t.Cleanup(end)
	select {
	case <-ready:
	case err := <-errs:
		t.Fatalf("port-forward: %v", err)
	}
	ports, err := fw.GetPorts()
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(ports[0].Local))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, end
}
