package egressproxy

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/testinet"
)

// TestLookupAsksTheGuestsName (docs/security.md): the agent runs with a pod's resolv.conf,
// whose search domains (the cluster's, ndots:5) would be tried before the name itself; a
// tenant's Service "allowed" in a namespace "test" is allowed.test.svc.cluster.local, which would
// capture every VM's allowed.test. The proxy resolves the name it was given, and only that.
// The test runs itself again in mount and network namespaces of its own, where /etc/resolv.conf
// lists a cluster's search domains and a DNS server answers both names.
func TestLookupAsksTheGuestsName(t *testing.T) {
	if os.Getenv("IMP_TEST_RESOLV_CONF") == "" {
		if os.Geteuid() != 0 {
			t.Skip("needs root: mount and network namespaces")
		}
		conf := filepath.Join(t.TempDir(), "resolv.conf")
		if err := os.WriteFile(conf, []byte("nameserver 10.0.0.10\n"+
			"search imp-system.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("unshare", "--mount", "--net", "--propagation", "private", "sh", "-c",
			`mount --bind "$1" /etc/resolv.conf && ip link set lo up && exec "$2" -test.run '^TestLookupAsksTheGuestsName$' -test.v`,
			"sh", conf, os.Args[0])
		cmd.Env = append(os.Environ(), "IMP_TEST_RESOLV_CONF="+conf)
		out, err := cmd.CombinedOutput()
		t.Logf("in its own namespaces:\n%s", out)
		if err != nil {
			t.Fatalf("the test in its own namespaces: %v", err)
		}
		return
	}
	testinet.ServeDNS(t, "/proc/self/ns/net", "127.0.0.1:53", map[string]string{
		"allowed.test.svc.cluster.local.": "10.96.0.5", // the tenant's Service
		"allowed.test.":                   "203.0.113.10",
	})
	r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, "127.0.0.1:53")
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, name := range []string{"allowed.test", "allowed.test."} {
		got, err := lookup(ctx, r, "127.0.0.1:53", name)
		if want := []netip.Addr{netip.MustParseAddr("203.0.113.10")}; err != nil || len(got) != 1 || got[0] != want[0] {
			t.Errorf("%s resolved to %v %v, want %v", name, got, err, want)
		}
	}
	_, err := lookup(ctx, r, "127.0.0.1:53", "missing.test")
	if de := (*net.DNSError)(nil); !errors.As(err, &de) || !de.IsNotFound || de.Server != "127.0.0.1:53" {
		t.Errorf("an unknown name: %v, want not found, naming the server asked", err)
	}
}
