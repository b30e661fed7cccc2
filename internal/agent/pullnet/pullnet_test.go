package pullnet_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/syscode-labs/imp/internal/agent/pullnet"
)

// TestLocalRegistriesOnlyWhenNamed: a server on the node's loopback is reached only when the
// allowed list names it (by host and port, or by host), by its address or by a name that
// resolves to it; a named registry's redirect to another local server is refused.
func TestLocalRegistriesOnlyWhenNamed(t *testing.T) {
	secret := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "node secrets") }))
	t.Cleanup(secret.Close)
	redirect := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, secret.URL+"/v2/", http.StatusTemporaryRedirect)
	}))
	t.Cleanup(redirect.Close)
	host := func(u string) string { return strings.TrimPrefix(u, "http://") }
	get := func(allowed []string, url string) (string, error) {
		c := &http.Client{Transport: pullnet.Transport(allowed)}
		resp, err := c.Get(url)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	}
	if pullnet.Transport(nil).Proxy == nil {
		t.Error("the node's proxy settings are not used")
	}
	localhost := "http://localhost:" + secret.URL[strings.LastIndex(secret.URL, ":")+1:]
	for _, tc := range []struct {
		name    string
		allowed []string
		url     string
		ok      bool
	}{
		{"not named", nil, secret.URL, false},
		{"not named, by a name", nil, localhost, false},
		{"another port named", []string{host(redirect.URL)}, secret.URL, false},
		{"named by host and port", []string{host(secret.URL)}, secret.URL, true},
		{"named by host", []string{"127.0.0.1"}, secret.URL, true},
		{"named by its address, reached by a name", []string{"127.0.0.1"}, localhost, false},
		{"a named registry's redirect to a local server", []string{host(redirect.URL)}, redirect.URL, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body, err := get(tc.allowed, tc.url)
			if tc.ok != (err == nil) {
				t.Fatalf("GET %s with %v: %q, %v; want reached %v", tc.url, tc.allowed, body, err, tc.ok)
			}
			if err != nil && !strings.Contains(err.Error(), "loopback or link-local") {
				t.Errorf("refused for another reason: %v", err)
			}
			if !tc.ok && strings.Contains(body, "node secrets") {
				t.Error("the local server's answer got through")
			}
		})
	}
}
