// Package testregistry gives tests a real OCI registry on 127.0.0.1 (go-containerregistry's,
// in memory, optionally behind basic auth) and a way to push small images to it.
package testregistry

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// Start serves a registry until the test ends and returns its host:port. With a user, every
// request needs that user's basic auth.
func Start(t testing.TB, user, pass string) string {
	t.Helper()
	h := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	if user != "" {
		next := h
		h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if u, p, ok := r.BasicAuth(); !ok || u != user || p != pass {
				w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// StartSlow serves a registry like Start (without auth) whose blobs, once slow is called,
// trickle out at one byte a second, and returns its host:port: a tenant's registry at its worst.
func StartSlow(t testing.TB) (host string, slow func()) {
	t.Helper()
	h := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	var on atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !on.Load() || r.Method != http.MethodGet || !strings.Contains(r.URL.Path, "/blobs/") {
			h.ServeHTTP(w, r)
			return
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		for _, b := range rec.Body.Bytes() {
			if _, err := w.Write([]byte{b}); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			select {
			case <-r.Context().Done():
				return
			case <-time.After(time.Second):
			}
		}
	}))
	t.Cleanup(func() { srv.CloseClientConnections(); srv.Close() })
	return strings.TrimPrefix(srv.URL, "http://"), func() { on.Store(true) }
}

// Layer makes an image layer of a tar.
func Layer(t testing.TB, tarData []byte) v1.Layer {
	t.Helper()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(tarData)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// Bomb makes a layer that compresses to little and extracts to one file of size zeros, with a
// tag file that tells bombs apart: the tar is made as it is read, never held in memory.
func Bomb(t testing.TB, tag string, size int64) v1.Layer {
	t.Helper()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		pr, pw := io.Pipe()
		go func() {
			tw := tar.NewWriter(pw)
			err := tw.WriteHeader(&tar.Header{Name: "tag", Mode: 0o644, Size: int64(len(tag)), Typeflag: tar.TypeReg})
			if err == nil {
				_, err = tw.Write([]byte(tag))
			}
			if err == nil {
				err = tw.WriteHeader(&tar.Header{Name: "zeros", Mode: 0o644, Size: size, Typeflag: tar.TypeReg})
			}
			if err == nil {
				_, err = io.CopyN(tw, zeros{}, size)
			}
			if err == nil {
				err = tw.Close()
			}
			pw.CloseWithError(err)
		}()
		return pr, nil
	}, tarball.WithCompressionLevel(gzip.BestSpeed))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// File is a regular file of a layer, or a directory when Dir is set.
type File struct {
	Name     string
	Mode     int64
	Data     []byte
	Dir      bool
	Uid, Gid int
}

// FilesLayer makes a layer of regular files.
func FilesLayer(t testing.TB, files ...File) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		h := &tar.Header{Name: f.Name, Mode: f.Mode, Size: int64(len(f.Data)), Typeflag: tar.TypeReg, Uid: f.Uid, Gid: f.Gid}
		if f.Dir {
			h.Typeflag, h.Size = tar.TypeDir, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(f.Data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return Layer(t, buf.Bytes())
}

// Push writes an image of layers to host/repo:v1 and returns its digest reference.
func Push(t testing.TB, host, repo string, kc authn.Keychain, layers ...v1.Layer) name.Digest {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	return write(t, host, repo, kc, img)
}

// PushWithEntrypoint is Push of an image whose config has entrypoint, with kc's credentials.
func PushWithEntrypoint(t testing.TB, host, repo string, kc authn.Keychain, entrypoint []string, layers ...v1.Layer) name.Digest {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	img, err = mutate.Config(img, v1.Config{Entrypoint: entrypoint, Env: []string{"PATH=/bin"}})
	if err != nil {
		t.Fatal(err)
	}
	return write(t, host, repo, kc, img)
}

func write(t testing.TB, host, repo string, kc authn.Keychain, img v1.Image) name.Digest {
	t.Helper()
	ref, err := name.ParseReference(host+"/"+repo+":v1", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img, remote.WithAuthFromKeychain(kc)); err != nil {
		t.Fatal(err)
	}
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return ref.Context().Digest(d.String())
}

// StartImpostor serves, until the test ends, a registry that claims to hold image d (of
// another registry, read with kc) without holding its content: every manifest request, by
// any tag or digest, is answered 200 with d's digest and its manifest (which, like the
// config, it also serves: both may leak), and every other blob with bytes that are not it.
// It returns its host:port and the number of requests it got.
func StartImpostor(t testing.TB, d name.Digest, kc authn.Keychain) (string, *atomic.Int64) {
	t.Helper()
	desc, err := remote.Get(d, remote.WithAuthFromKeychain(kc))
	if err != nil {
		t.Fatal(err)
	}
	img, err := desc.Image()
	if err != nil {
		t.Fatal(err)
	}
	config, err := img.RawConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	configDigest, err := img.ConfigName()
	if err != nil {
		t.Fatal(err)
	}
	requests := new(atomic.Int64)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		switch p := r.URL.Path; {
		case p == "/v2/" || p == "/v2":
			w.WriteHeader(http.StatusOK)
		case strings.Contains(p, "/manifests/"):
			w.Header().Set("Docker-Content-Digest", d.DigestStr())
			w.Header().Set("Content-Type", string(desc.MediaType))
			w.Header().Set("Content-Length", fmt.Sprint(len(desc.Manifest)))
			if r.Method != http.MethodHead {
				_, _ = w.Write(desc.Manifest)
			}
		case strings.HasSuffix(p, "/blobs/"+configDigest.String()):
			_, _ = w.Write(config)
		case strings.Contains(p, "/blobs/"):
			_, _ = w.Write([]byte("not the layer you are looking for"))
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://"), requests
}
