package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/testinet"
	"github.com/syscode-labs/imp/internal/testnetns"
)

// The e2e's internet: a namespace the test makes beside the node, with HTTP, TLS and DNS
// servers (the agent's domain egress proxy asks its DNS server: values-this-machine.yaml).
const (
	inetNode       = "203.0.113.1"
	inetServer     = "203.0.113.10"
	inetNameserver = inetServer + ":53"
)

// checkDomainEgress (docs/networking.md, "Domain egress"): a real guest on a network whose
// egress names allowed.test and *.allowed.test reaches those over HTTP and TLS through the
// real node's agent; another name, an allowed name dialled at an internal address (as the
// guest's /etc/hosts would), and one whose DNS answer is the node are reset; the refusal is
// an Event naming the name.
func checkDomainEgress(t *testing.T, sh func(string) (string, error), must func(string, ...string) string,
	eventually func(string, time.Duration, func() error), dir, image, node string) {
	t.Helper()
	inet := testnetns.New(t, "imp-e2e-inet")
	testnetns.Link(t, "/proc/self/ns/net", "tinet0", inetNode+"/24", inet, "eth0", inetServer+"/24")
	testinet.ServeHTTP(t, inet, inetServer+":80")
	testinet.ServeTLS(t, inet, inetServer+":443")
	asked := testinet.ServeDNS(t, inet, inetNameserver, map[string]string{
		"allowed.test.":      inetServer,
		"api.allowed.test.":  inetServer,
		"other.test.":        inetServer,
		"home.allowed.test.": inetNode, // the node's own address
	})
	objs := fmt.Sprintf(`apiVersion: v1
kind: Namespace
metadata: {name: np-dom}
---
apiVersion: imp.dev/v1alpha1
kind: ImpNetwork
metadata: {name: dom, namespace: np-dom}
spec:
  cidr: 10.103.0.0/24
  nat: {enabled: true}
  egress: {domains: [allowed.test, "*.allowed.test"]}
---
apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata: {name: vd, namespace: np-dom}
spec:
  image: %s
  command: [/bin/hello]
  args: [tool-reach, serve, vd, "8080"]
  resources: {vcpus: 1, memory: 192Mi}
  diskSize: 64Mi
  nodeSelector: {imp.test/node: %s}
  networkRef: {name: dom}
`, image, node)
	if err := os.WriteFile(filepath.Join(dir, "domains.yaml"), []byte(objs), 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl apply -f domains.yaml")
	get := func(args ...string) string {
		out, _ := sh("kubectl imp -n np-dom exec vd -- /bin/hello tool-reach get " + strings.Join(args, " "))
		return strings.TrimSpace(out)
	}
	// The VM boots; then its first request must pass. What refused one says why (its Event).
	for start := time.Now(); ; time.Sleep(time.Second) {
		got := get("allowed.test", inetServer+":80")
		if strings.HasPrefix(got, "http hello from allowed.test") {
			break
		}
		if time.Since(start) > 4*time.Minute {
			ev, _ := sh("kubectl -n np-dom get events --sort-by=.lastTimestamp | tail -20")
			where, _ := sh("ip route get 203.0.113.10; ip -br addr; ip route; ip netns list; ss -ulpn | grep ':53 '")
			t.Fatalf("vd never reached allowed.test through the proxy: %q\n%s\nthe DNS server was asked:\n%s\nthe node:\n%s", got, ev,
				strings.Join(asked(), "\n"), where)
		}
	}
	for _, c := range []struct{ what, args, want string }{
		{"an allowed name over TLS", "--tls allowed.test " + inetServer + ":443", "tls hello from allowed.test"},
		{"a wildcard's name", "api.allowed.test " + inetServer + ":80", "http hello from api.allowed.test"},
		{"another name", "other.test " + inetServer + ":80", "reset"},
		{"another name over TLS", "--tls other.test " + inetServer + ":443", "reset"},
		{"an allowed name dialled at an internal address", "allowed.test 10.96.0.1:80", "reset"},
		{"an allowed name whose answer is the node", "home.allowed.test " + inetServer + ":80", "reset"},
	} {
		if got := get(strings.Fields(c.args)...); !strings.HasPrefix(got, c.want) {
			t.Errorf("domain egress, %s: %q, want %q", c.what, got, c.want)
		}
	}
	eventually("the refusal reported", time.Minute, func() error {
		out, err := sh("kubectl -n np-dom get events --field-selector reason=EgressRefused -o jsonpath='{.items[*].message}'")
		if err != nil || !strings.Contains(out, `"other.test"`) {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	})
	must("kubectl delete namespace np-dom --timeout=5m")
}
