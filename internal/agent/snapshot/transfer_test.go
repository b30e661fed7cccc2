package snapshot

import (
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/testregistry"
)

// TestSealOpen: a sealed file opens with its key for its name only; a byte changed, a chunk cut
// off, bytes appended or too many bytes fail.
func TestSealOpen(t *testing.T) {
	key, _ := NewKey()
	plain := make([]byte, 3*sealChunk+123) // several chunks, incompressible
	_, _ = rand.Read(plain)
	var sealed bytes.Buffer
	if err := Seal(&sealed, bytes.NewReader(plain), key, "state"); err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(sealed.Bytes(), plain[:64]) {
		t.Fatal("the sealed file holds the plain text")
	}
	var out bytes.Buffer
	if err := Open(&out, bytes.NewReader(sealed.Bytes()), key, "state", int64(len(plain))); err != nil || !bytes.Equal(out.Bytes(), plain) {
		t.Fatalf("open: %v (equal %v)", err, bytes.Equal(out.Bytes(), plain))
	}
	other, _ := NewKey()
	s := sealed.Bytes()
	for what, c := range map[string]struct {
		data []byte
		key  []byte
		name string
		max  int64
	}{
		"another key":        {s, other, "state", 1 << 30},
		"another file name":  {s, key, "rw.ext4", 1 << 30},
		"a byte changed":     {flip(s, len(s)/2), key, "state", 1 << 30},
		"the last chunk cut": {s[:lastChunk(t, s)], key, "state", 1 << 30},
		"bytes appended":     {append(bytes.Clone(s), 1, 2, 3), key, "state", 1 << 30},
		"over its limit":     {s, key, "state", int64(len(plain)) - 1},
	} {
		if err := Open(&bytes.Buffer{}, bytes.NewReader(c.data), c.key, c.name, c.max); err == nil {
			t.Errorf("%s: opened", what)
		}
	}
	// Zeros (a sparse disk, free memory) cost next to nothing.
	var zeros bytes.Buffer
	if err := Seal(&zeros, bytes.NewReader(make([]byte, 64<<20)), key, "rw.ext4"); err != nil || zeros.Len() > 64<<10 {
		t.Errorf("64 MiB of zeros sealed into %d bytes (%v)", zeros.Len(), err)
	}
}

func flip(b []byte, i int) []byte {
	c := bytes.Clone(b)
	c[i] ^= 1
	return c
}

// lastChunk is the offset of the final chunk of a sealed file.
func lastChunk(t *testing.T, s []byte) int {
	off := len(sealMagic) + 8
	last := off
	for off < len(s) {
		last = off
		off += 4 + int(uint32(s[off])<<24|uint32(s[off+1])<<16|uint32(s[off+2])<<8|uint32(s[off+3]))
	}
	return last
}

// TestPushPull: a snapshot pushed to a real registry on 127.0.0.1 comes back whole into another
// node's store, sparse; the registry holds no plain byte of it. Pulled with another key, under
// another snapshot's identity, with a file it may not hold, past a limit, or from a registry
// that changes a blob, nothing is put in place.
func TestPushPull(t *testing.T) {
	ctx := context.Background()
	host := testregistry.Start(t, "", "")
	src := &Store{Dir: filepath.Join(t.TempDir(), "a")}
	uid := types.UID("snap-uid")
	tmp, err := src.Begin(uid)
	if err != nil {
		t.Fatal(err)
	}
	secret := bytes.Repeat([]byte("tenant memory "), 1000)
	state := append(make([]byte, 8<<20), secret...)
	_ = os.WriteFile(filepath.Join(tmp, StateFile), state, 0o600)
	f, _ := os.Create(filepath.Join(tmp, DiskFile))
	_ = f.Truncate(256 << 20)
	_, _ = f.WriteAt([]byte("disk data"), 128<<20)
	f.Close()
	if err := src.Commit(tmp, &Manifest{Namespace: "ns", Name: "snap", UID: uid, Token: "t"}); err != nil {
		t.Fatal(err)
	}
	key, _ := NewKey()
	ref, _ := name.ParseReference(host+"/snaps/snap:"+string(uid), name.Insecure)
	digest, err := src.Push(ctx, uid, ref, key)
	if err != nil {
		t.Fatal(err)
	}
	d, _ := name.NewDigest(ref.Context().String()+"@"+digest, name.Insecure)
	limits := map[string]int64{ManifestFile: 1 << 20, StateFile: 16 << 20, DiskFile: 256 << 20}

	dst := &Store{Dir: filepath.Join(t.TempDir(), "b")}
	if err := dst.Pull(ctx, uid, "ns", "snap", d, key, limits); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{StateFile, DiskFile} {
		a, _ := os.ReadFile(src.File(uid, f))
		b, _ := os.ReadFile(dst.File(uid, f))
		if !bytes.Equal(a, b) {
			t.Errorf("%s differs after the round trip", f)
		}
	}
	if n, _ := disk.Allocated(dst.File(uid, DiskFile)); n > 1<<20 {
		t.Errorf("the pulled disk allocates %d bytes", n)
	}
	if m, err := dst.Read(uid); err != nil || m.Token != "t" {
		t.Errorf("the pulled manifest: %+v %v", m, err)
	}

	refused := func(what string, err error) {
		t.Helper()
		if err == nil {
			t.Errorf("%s: pulled", what)
		}
		if _, serr := os.Stat(dst.Path("other")); serr == nil {
			t.Errorf("%s: something was put in place", what)
		}
	}
	other, _ := NewKey()
	refused("another key", dst.Pull(ctx, "other", "ns", "snap", d, other, limits))
	refused("another snapshot's identity", dst.Pull(ctx, "other", "ns", "snap", d, key, limits))
	_ = os.RemoveAll(dst.Path(uid))
	refused("another namespace", dst.Pull(ctx, uid, "ns2", "snap", d, key, limits))
	refused("a file it may not hold", dst.Pull(ctx, uid, "ns", "snap", d, key, map[string]int64{ManifestFile: 1 << 20, StateFile: 16 << 20}))
	refused("past a limit", dst.Pull(ctx, uid, "ns", "snap", d, key, map[string]int64{ManifestFile: 1 << 20, StateFile: 1 << 20, DiskFile: 256 << 20}))
	if _, err := os.Stat(dst.Path(uid)); err == nil {
		t.Error("a refused pull left the snapshot in place")
	}

	// A registry that changes a blob on the way.
	up, _ := url.Parse("http://" + host)
	proxy := httputil.NewSingleHostReverseProxy(up)
	proxy.ModifyResponse = func(r *http.Response) error {
		if strings.Contains(r.Request.URL.Path, "/blobs/") && r.Request.Method == http.MethodGet {
			body := new(bytes.Buffer)
			_, _ = body.ReadFrom(r.Body)
			b := body.Bytes()
			if len(b) > 100 {
				b[len(b)-20] ^= 0xff
			}
			r.Body = io.NopCloser(bytes.NewReader(b))
			r.ContentLength = int64(len(b))
		}
		return nil
	}
	evil := httptest.NewServer(proxy)
	t.Cleanup(evil.Close)
	ed, _ := name.NewDigest(strings.TrimPrefix(evil.URL, "http://")+"/snaps/snap@"+digest, name.Insecure)
	refused("a changed blob", dst.Pull(ctx, uid, "ns", "snap", ed, key, limits))

	// The registry holds ciphertext only.
	var stored []byte
	for _, l := range mustLayers(t, d) {
		stored = append(stored, l...)
	}
	if bytes.Contains(stored, []byte("tenant memory tenant memory")) || bytes.Contains(stored, []byte("disk data")) {
		t.Error("the registry holds plain bytes of the snapshot")
	}
}

// mustLayers are the stored bytes of each layer of d.
func mustLayers(t *testing.T, d name.Digest) [][]byte {
	t.Helper()
	img, err := remote.Image(d)
	if err != nil {
		t.Fatal(err)
	}
	ls, _ := img.Layers()
	var out [][]byte
	for _, l := range ls {
		rc, err := l.Compressed()
		if err != nil {
			t.Fatal(err)
		}
		b := new(bytes.Buffer)
		_, _ = b.ReadFrom(rc)
		rc.Close()
		out = append(out, b.Bytes())
	}
	return out
}
