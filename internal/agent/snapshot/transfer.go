package snapshot

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	ggcrtypes "github.com/google/go-containerregistry/pkg/v1/types"
	"k8s.io/apimachinery/pkg/types"
)

// Media types and annotations of a snapshot pushed to a registry: an OCI image manifest whose
// layers are the snapshot's files, each sealed (Seal), named by the layer's title annotation.
const (
	ArtifactAnnotation = "dev.imp.snapshot"
	ArtifactVersion    = "v1"
	sealedFileType     = ggcrtypes.MediaType("application/vnd.imp.snapshot.file.v1.zstd+aes256gcm")
	configType         = ggcrtypes.MediaType("application/vnd.imp.snapshot.config.v1+json")
	titleAnnotation    = "org.opencontainers.image.title"
	// maxFiles bounds the files of a pulled snapshot.
	maxFiles = 8
)

// Push seals every file of the snapshot with uid with key and pushes them to ref, returning the
// manifest's digest. The registry gets ciphertext, the files' names and their sealed sizes.
func (s *Store) Push(ctx context.Context, uid types.UID, ref name.Reference, key []byte, opts ...remote.Option) (string, error) {
	entries, err := os.ReadDir(s.Path(uid))
	if err != nil {
		return "", err
	}
	work := s.Path(uid) + ".push"
	if err := os.RemoveAll(work); err != nil {
		return "", err
	}
	if err := os.Mkdir(work, 0o700); err != nil {
		return "", err
	}
	defer os.RemoveAll(work)
	var adds []mutate.Addendum
	for _, e := range entries {
		if !e.Type().IsRegular() {
			continue
		}
		l, err := sealFile(s.File(uid, e.Name()), filepath.Join(work, e.Name()), key, e.Name())
		if err != nil {
			return "", err
		}
		adds = append(adds, mutate.Addendum{Layer: l, MediaType: sealedFileType, Annotations: map[string]string{titleAnnotation: e.Name()}})
	}
	img, err := mutate.Append(empty.Image, adds...)
	if err != nil {
		return "", err
	}
	img = mutate.ConfigMediaType(mutate.MediaType(img, ggcrtypes.OCIManifestSchema1), configType)
	img = mutate.Annotations(img, map[string]string{ArtifactAnnotation: ArtifactVersion}).(v1.Image)
	if err := remote.Write(ref, img, append(opts, remote.WithContext(ctx))...); err != nil {
		return "", fmt.Errorf("pushing the snapshot to %s: %w", ref, err)
	}
	d, err := img.Digest()
	if err != nil {
		return "", err
	}
	return d.String(), nil
}

// sealFile seals src into dst and returns it as a layer.
func sealFile(src, dst string, key []byte, fileName string) (v1.Layer, error) {
	in, err := os.OpenFile(src, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	h := sha256.New()
	cw := &countWriter{w: io.MultiWriter(out, h)}
	if err := Seal(cw, in, key, fileName); err != nil {
		out.Close()
		return nil, fmt.Errorf("sealing %s: %w", fileName, err)
	}
	if err := out.Close(); err != nil {
		return nil, err
	}
	return &sealedLayer{path: dst, digest: v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(h.Sum(nil))}, size: cw.n}, nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// sealedLayer is a sealed file as a layer: its bytes are what the registry stores.
type sealedLayer struct {
	path   string
	digest v1.Hash
	size   int64
}

func (l *sealedLayer) Digest() (v1.Hash, error)                { return l.digest, nil }
func (l *sealedLayer) DiffID() (v1.Hash, error)                { return l.digest, nil }
func (l *sealedLayer) Compressed() (io.ReadCloser, error)      { return os.Open(l.path) }
func (l *sealedLayer) Uncompressed() (io.ReadCloser, error)    { return os.Open(l.path) }
func (l *sealedLayer) Size() (int64, error)                    { return l.size, nil }
func (l *sealedLayer) MediaType() (ggcrtypes.MediaType, error) { return sealedFileType, nil }

var _ v1.Layer = (*sealedLayer)(nil)

// Pull fetches the snapshot with uid from ref (by digest) into the store, opening each file
// with key: only the files named in limits, each at most its limit, none twice; the manifest
// must be the snapshot's (its uid, namespace and name). The snapshot is in place whole or not
// at all.
func (s *Store) Pull(ctx context.Context, uid types.UID, namespace, snapName string, ref name.Digest, key []byte, limits map[string]int64, opts ...remote.Option) error {
	img, err := remote.Image(ref, append(opts, remote.WithContext(ctx))...)
	if err != nil {
		return fmt.Errorf("fetching the snapshot from %s: %w", ref, err)
	}
	mf, err := img.Manifest()
	if err != nil {
		return err
	}
	if mf.Annotations[ArtifactAnnotation] != ArtifactVersion || len(mf.Layers) > maxFiles {
		return fmt.Errorf("%s is no IMP snapshot", ref)
	}
	tmp, err := s.Begin(uid)
	if err != nil {
		return err
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.RemoveAll(tmp)
		}
	}()
	seen := map[string]bool{}
	for _, desc := range mf.Layers {
		fileName := desc.Annotations[titleAnnotation]
		limit, allowed := limits[fileName]
		if !allowed || seen[fileName] || desc.MediaType != sealedFileType {
			return fmt.Errorf("the snapshot at %s holds a file %q it may not", ref, fileName)
		}
		seen[fileName] = true
		if err := pullFile(img, desc.Digest, filepath.Join(tmp, fileName), key, fileName, limit); err != nil {
			return err
		}
		if fileName == BaseFile {
			if err := os.Chmod(filepath.Join(tmp, fileName), 0o444); err != nil { // as the node's base disks
				return err
			}
		}
	}
	m, err := readManifest(filepath.Join(tmp, ManifestFile))
	if err != nil {
		return err
	}
	if m.UID != uid || m.Namespace != namespace || m.Name != snapName {
		return fmt.Errorf("the snapshot at %s is %s/%s (%s), not %s/%s (%s)", ref, m.Namespace, m.Name, m.UID, namespace, snapName, uid)
	}
	if err := os.Rename(tmp, s.Path(uid)); err != nil {
		return err
	}
	ok = true
	return syncPath(s.Dir)
}

func pullFile(img v1.Image, digest v1.Hash, dst string, key []byte, fileName string, limit int64) error {
	l, err := img.LayerByDigest(digest)
	if err != nil {
		return err
	}
	rc, err := l.Compressed() // checked against its digest as it is read
	if err != nil {
		return fmt.Errorf("fetching the snapshot's %s: %w", fileName, err)
	}
	defer rc.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	sw := &sparseWriter{f: out}
	if err := Open(sw, rc, key, fileName, limit); err != nil {
		out.Close()
		return err
	}
	if err := out.Truncate(sw.off); err != nil { // the file's size: holes at its end too
		out.Close()
		return err
	}
	if err := out.Sync(); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// sparseWriter writes a file leaving holes where whole blocks are zero, so that a pulled
// disk is as sparse as the pushed one was.
type sparseWriter struct {
	f   *os.File
	off int64
}

func (w *sparseWriter) Write(p []byte) (int, error) {
	const block = 4096
	total := len(p)
	for len(p) > 0 {
		n := min(block-int(w.off%block), len(p))
		if !allZero(p[:n]) {
			if _, err := w.f.WriteAt(p[:n], w.off); err != nil {
				return 0, err
			}
		}
		w.off += int64(n)
		p = p[n:]
	}
	return total, nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
