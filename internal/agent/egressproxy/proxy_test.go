package egressproxy

import (
	"bytes"
	"crypto/tls"
	"net"
	"testing"
	"time"
)

// clientHello is the first flight of a real TLS client asking for name.
func clientHello(t testing.TB, name string) []byte {
	a, b := net.Pipe()
	go func() {
		c := tls.Client(a, &tls.Config{ServerName: name, InsecureSkipVerify: true}) //nolint:gosec // never completes
		_ = c.SetDeadline(time.Now().Add(time.Second))
		_ = c.Handshake()
	}()
	buf := make([]byte, 16<<10)
	_ = b.SetReadDeadline(time.Now().Add(time.Second))
	n, _ := b.Read(buf)
	a.Close()
	b.Close()
	return buf[:n]
}

// TestParseName: the name of a real ClientHello and of HTTP requests; what is incomplete waits
// for more; what is malformed, or names no domain, is refused.
func TestParseName(t *testing.T) {
	hello := clientHello(t, "api.github.com")
	for _, tc := range []struct {
		name     string
		in       []byte
		want     string
		complete bool
		err      bool
	}{
		{"a ClientHello", hello, "api.github.com", true, false},
		{"half a ClientHello", hello[:len(hello)/2], "", false, false},
		{"a record header alone", hello[:5], "", false, false},
		{"a request", []byte("GET / HTTP/1.1\r\nHost: Files.PyPI.org:80\r\n\r\n"), "Files.PyPI.org", true, false},
		{"a request's first line", []byte("GET / HTTP/1.1\r\nHost: x"), "", false, false},
		{"a request without Host", []byte("GET / HTTP/1.0\r\n\r\n"), "", true, true},
		{"garbage", []byte("\x00\x01\x02\r\n\r\n"), "", true, true},
		{"a handshake record that is no ClientHello", []byte{0x16, 3, 1, 0, 4, 2, 0, 0, 0}, "", true, true},
		{"a ClientHello whose lengths lie", append([]byte{0x16, 3, 1, 0, 9, 1, 0, 0, 5, 3, 3}, bytes.Repeat([]byte{0xff}, 4)...), "", true, true},
	} {
		name, complete, err := parseName(tc.in)
		if name != tc.want || complete != tc.complete || (err != nil) != tc.err {
			t.Errorf("%s: %q complete %v err %v; want %q %v err %v", tc.name, name, complete, err, tc.want, tc.complete, tc.err)
		}
	}
}

// TestDomains: exact names and one leading wildcard label.
func TestDomains(t *testing.T) {
	d := Domains{"api.github.com", "*.pypi.org"}
	for name, want := range map[string]bool{
		"api.github.com": true, "github.com": false, "x.api.github.com": false,
		"files.pypi.org": true, "a.b.pypi.org": true, "pypi.org": false, "evilpypi.org": false, "pypi.org.evil.com": false,
	} {
		if got := d.Allows(name); got != want {
			t.Errorf("%s: %v, want %v", name, got, want)
		}
	}
}

// FuzzParseName: whatever a guest sends first, the parser returns without a panic, and a name
// it calls complete without error is one the bytes hold.
func FuzzParseName(f *testing.F) {
	f.Add(clientHello(f, "api.github.com"))
	f.Add([]byte("GET / HTTP/1.1\r\nHost: a.b\r\n\r\n"))
	f.Add([]byte{0x16, 3, 1, 0, 4, 1, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) == 0 {
			return
		}
		name, complete, err := parseName(b)
		if complete && err == nil && !bytes.Contains(b, []byte(name)) {
			t.Fatalf("name %q is not in the input", name)
		}
	})
}
