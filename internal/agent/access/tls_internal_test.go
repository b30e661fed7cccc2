package access

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/pki"
)

// A certificate kept on the node serves after a restart: this node's only, and unexpired.
func TestKeptCertificate(t *testing.T) {
	now := time.Now()
	ca, err := pki.NewCA("ca", now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	issue := func(node string, life time.Duration) pki.Pair {
		p, err := pki.Issue(ca, pki.Request{CommonName: pki.AgentName, DNSNames: []string{pki.AgentDNSName(node)}, Server: true, Lifetime: life}, now)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, tc := range []struct {
		name  string
		write func(c *CSR)
		ok    bool
	}{
		{"its node's", func(c *CSR) { p := issue("n1", 30*time.Minute); _ = c.keep(append(p.Cert, ca.Cert...), p.Key) }, true},
		{"another node's", func(c *CSR) { p := issue("n2", 30*time.Minute); _ = c.keep(append(p.Cert, ca.Cert...), p.Key) }, false},
		{"expired", func(c *CSR) { p := issue("n1", -time.Minute); _ = c.keep(append(p.Cert, ca.Cert...), p.Key) }, false},
		{"garbage", func(c *CSR) { _ = os.WriteFile(filepath.Join(c.Dir, KeptFile), []byte("garbage"), 0o600) }, false},
		{"none", func(*CSR) {}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &CSR{Node: "n1", Dir: t.TempDir()}
			tc.write(c)
			if l := c.kept(); (l != nil) != tc.ok {
				t.Fatalf("kept: %v, want %v", l != nil, tc.ok)
			}
			if tc.ok {
				if fi, err := os.Stat(filepath.Join(c.Dir, KeptFile)); err != nil || fi.Mode().Perm() != 0o600 {
					t.Errorf("the kept file: %v %v", fi.Mode(), err)
				}
			}
		})
	}
}
