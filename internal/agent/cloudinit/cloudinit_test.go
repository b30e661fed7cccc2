package cloudinit_test

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	diskfs "github.com/diskfs/go-diskfs"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/cloudinit"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// TestSeed: the seed disk is a FAT32 file system labelled cidata (what cloud-init's NoCloud
// looks for) holding meta-data with the VM's instance and name, the user data as given, and
// network-config only when the VM gives one.
func TestSeed(t *testing.T) {
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Name: "debian", UID: "6f1c"}, Spec: impv1.ImpVMSpec{Boot: impv1.BootOS,
		CloudInit: &impv1.CloudInit{UserData: "#cloud-config\nhostname: ignored\n"}}}
	vm.Status.Instance = 3
	dir := t.TempDir()
	path := filepath.Join(dir, cloudinit.File)
	if err := cloudinit.Write(path, cloudinit.For(vm, nil)); err != nil {
		t.Fatal(err)
	}
	files := read(t, path)
	if got := files["/meta-data"]; got != "instance-id: \"6f1c.3\"\nlocal-hostname: \"debian\"\n" {
		t.Errorf("meta-data %q", got)
	}
	if got := files["/user-data"]; got != vm.Spec.CloudInit.UserData {
		t.Errorf("user-data %q", got)
	}
	if _, ok := files["/network-config"]; ok {
		t.Error("a network-config without the VM's networkData")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// FAT32's boot sector: the volume label at 0x47, the type at 0x52.
	if label, typ := strings.TrimSpace(string(b[0x47:0x52])), string(b[0x52:0x5a]); !strings.EqualFold(label, cloudinit.Label) || typ != "FAT32   " {
		t.Errorf("the seed's file system is %q labelled %q, want FAT32 labelled %s", typ, label, cloudinit.Label)
	}

	// From a Secret (the run's), with network data; written again in place.
	vm.Spec.CloudInit = &impv1.CloudInit{UserDataSecretRef: &impv1.SecretKeyReference{Name: "ud"}, NetworkData: "version: 2\n"}
	if err := cloudinit.Write(path, cloudinit.For(vm, []byte("#!/bin/sh\necho secret\n"))); err != nil {
		t.Fatal(err)
	}
	files = read(t, path)
	if files["/user-data"] != "#!/bin/sh\necho secret\n" || files["/network-config"] != "version: 2\n" {
		t.Errorf("the seed of a Secret's user data and network data: %q", files)
	}
	if err := cloudinit.Write(path, cloudinit.Data{UserData: make([]byte, cloudinit.MaxUserData+1)}); err == nil {
		t.Error("a seed of more user data than the bound was written")
	}
}

func read(t *testing.T, path string) map[string]string {
	t.Helper()
	d, err := diskfs.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	fs, err := d.GetFilesystem(0)
	if err != nil {
		t.Fatal(err)
	}
	entries, err := fs.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		f, err := fs.OpenFile("/"+e.Name(), os.O_RDONLY)
		if err != nil {
			t.Fatal(err)
		}
		var b bytes.Buffer
		if _, err := io.Copy(&b, f); err != nil {
			t.Fatal(err)
		}
		out["/"+strings.ToLower(e.Name())] = b.String()
	}
	return out
}

// TestSeedStep: the step makes and attaches the seed (read-only, its own drive, 0600) of a VM
// with spec.cloudInit, and a resume attaches the seed its guest saw without making it again.
func TestSeedStep(t *testing.T) {
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Name: "debian", UID: "6f1c"}, Spec: impv1.ImpVMSpec{Boot: impv1.BootOS,
		CloudInit: &impv1.CloudInit{UserData: "#cloud-config\n"}}}
	ctx := context.Background()
	r := &vmrun.Run{VM: vm, Dir: t.TempDir(), Image: &vmrun.Image{}}
	if do, err := (cloudinit.Seed{}).ShouldDo(ctx, r); err != nil || !do {
		t.Fatalf("ShouldDo %v %v", do, err)
	}
	if err := (cloudinit.Seed{}).Do(ctx, r); err != nil {
		t.Fatal(err)
	}
	if d := r.Volumes.Drives; len(d) != 1 || d[0].ID != cloudinit.DriveID || !d[0].ReadOnly || d[0].Path != filepath.Join(r.Dir, cloudinit.File) {
		t.Errorf("the seed's drive: %+v", d)
	}
	if do, _ := (cloudinit.Seed{}).ShouldDo(ctx, r); do {
		t.Error("the step would attach the seed twice")
	}
	// A resume: no image; the seed is there.
	resumed := &vmrun.Run{VM: vm, Dir: r.Dir, Meta: &vmrun.Meta{VMM: impv1.VMMQEMU}}
	if err := (cloudinit.Seed{}).Do(ctx, resumed); err != nil || len(resumed.Volumes.Drives) != 1 {
		t.Errorf("a resume's seed: %v %+v", err, resumed.Volumes)
	}
	if fi, err := os.Stat(filepath.Join(r.Dir, cloudinit.File)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("the seed's mode: %v %v, want 0600 (it holds user data)", fi.Mode(), err)
	}
}
