// Package testguest gives tests what booting a real guest takes: Debian's cloud kernel (fetched
// by hack/guest-kernel.sh), an initramfs with a freshly built imp-init, and an OCI image holding
// the test workload (./hello) pushed to a registry on 127.0.0.1.
package testguest

import (
	"archive/tar"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/syscode-labs/imp/internal/initramfs"
	"github.com/syscode-labs/imp/internal/testregistry"
)

// Kernel returns the guest kernel hack/guest-kernel.sh fetched into $IMP_CACHE.
func Kernel(t testing.TB) string {
	t.Helper()
	cache := os.Getenv("IMP_CACHE")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache", "imp")
	}
	ks, _ := filepath.Glob(filepath.Join(cache, "guest/kernel/boot/vmlinuz-*"))
	if len(ks) == 0 {
		t.Fatalf("no guest kernel in %s/guest (run hack/guest-kernel.sh)", cache)
	}
	return ks[0]
}

// Artifacts builds imp-init and an initramfs into dir and returns the kernel and initramfs.
func Artifacts(t testing.TB, dir string) (kernel, initrd string) {
	t.Helper()
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Fatal("qemu-system-x86_64 not found (Debian package qemu-system-x86; hack/install-prerequisites.sh installs it)")
	}
	kernel = Kernel(t)
	modules := filepath.Join(filepath.Dir(filepath.Dir(kernel)), "lib/modules", strings.TrimPrefix(filepath.Base(kernel), "vmlinuz-"))
	init := filepath.Join(dir, "imp-init")
	build(t, init, "github.com/syscode-labs/imp/cmd/imp-init")
	initrd = filepath.Join(dir, "initramfs.cpio.gz")
	f, err := os.Create(initrd)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := initramfs.Build(f, init, modules); err != nil {
		t.Fatal(err)
	}
	return kernel, initrd
}

// Image pushes an image holding /bin/hello (the test workload, entrypoint ["/bin/hello"]), a
// user app (uid 1000) and its home /home/app, and returns its digest reference.
func Image(t testing.TB, host, repo string) name.Digest {
	t.Helper()
	return ImageAs(t, host, repo, authn.DefaultKeychain)
}

// ImageAs is Image pushed with kc's credentials.
func ImageAs(t testing.TB, host, repo string, kc authn.Keychain) name.Digest {
	t.Helper()
	return ImageWith(t, host, repo, kc)
}

// ImageWith is ImageAs with extra files in its layer: an image of another digest.
func ImageWith(t testing.TB, host, repo string, kc authn.Keychain, extra ...testregistry.File) name.Digest {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "hello")
	build(t, bin, "github.com/syscode-labs/imp/internal/testguest/hello")
	hello, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	files := append([]testregistry.File{
		{Name: "bin/hello", Mode: 0o755, Data: hello},
		{Name: "etc/passwd", Mode: 0o644, Data: []byte("root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n")},
		{Name: "home/app/", Mode: 0o755, Dir: true, Uid: 1000, Gid: 1000},
	}, extra...)
	return testregistry.PushWithEntrypoint(t, host, repo, kc, []string{"/bin/hello"}, testregistry.FilesLayer(t, files...))
}

func build(t testing.TB, out, pkg string) {
	t.Helper()
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building %s: %v\n%s", pkg, err, b)
	}
}

// Entry is a tar entry of a layer and, for a regular file, its content.
type Entry struct {
	Header tar.Header
	Data   string
}

// Layer makes an image layer of entries.
func Layer(t testing.TB, entries ...Entry) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.Header
		h.Size = int64(len(e.Data))
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(e.Data)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return testregistry.Layer(t, buf.Bytes())
}

// Symlink is a symlink entry.
func Symlink(name, target string) Entry {
	return Entry{Header: tar.Header{Name: name, Linkname: target, Typeflag: tar.TypeSymlink, Mode: 0o777}}
}

// RegularFile is a file entry holding data.
func RegularFile(name, data string) Entry {
	return Entry{Header: tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644}, Data: data}
}
