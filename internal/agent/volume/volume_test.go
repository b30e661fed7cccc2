package volume

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// TestMake makes the volumes of a VM under QEMU: a mounted emptyDisk holds an ext4 file system
// labelled for volumes (never the VM's own disks' labels), a raw one zeros; both kept when made
// again (they hold what the guest wrote); downwardAPI files as the kubelet writes them.
func TestMake(t *testing.T) {
	dir := t.TempDir()
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "db", UID: "u1",
		Labels: map[string]string{"b": "2", "a": `q"uote`}, Annotations: map[string]string{"note": "x"}}}
	vm.Spec.Volumes = []impv1.Volume{
		{Name: "data", EmptyDisk: &impv1.EmptyDiskSource{Capacity: "32Mi"}},
		{Name: "raw", EmptyDisk: &impv1.EmptyDiskSource{Capacity: "16Mi"}},
		{Name: "info", DownwardAPI: &impv1.DownwardAPIVolumeSource{DefaultMode: ptr.To[int32](0o600), Items: []impv1.DownwardAPIVolumeFile{
			{Path: "labels", FieldRef: impv1.ObjectFieldSelector{FieldPath: "metadata.labels"}},
			{Path: "ns", FieldRef: impv1.ObjectFieldSelector{FieldPath: "metadata.namespace"}, Mode: ptr.To[int32](0o444)},
			{Path: "note", FieldRef: impv1.ObjectFieldSelector{FieldPath: "metadata.annotations['note']"}},
		}}},
	}
	vm.Spec.VolumeMounts = []impv1.VolumeMount{{Name: "data", MountPath: "/data"}, {Name: "info", MountPath: "/etc/info", ReadOnly: true}}
	vm.Spec.VolumeDevices = []impv1.VolumeDevice{{Name: "raw", DevicePath: "/dev/raw0"}}
	m := Maker{ChooseVMM: func(*impv1.ImpVM) (impv1.VMMKind, error) { return impv1.VMMQEMU, nil }}
	r := &vmrun.Run{VM: vm, Dir: dir, Image: &vmrun.Image{}}
	v, err := m.Make(r)
	if err != nil {
		t.Fatal(err)
	}
	if len(v.Drives) != 2 || v.Drives[0].Serial != "imp-vol0" || v.Drives[1].Serial != "imp-vol1" || v.Drives[0].Path != filepath.Join(dir, "vol-data.img") {
		t.Errorf("drives %+v", v.Drives)
	}
	label := make([]byte, 16)
	f, err := os.Open(filepath.Join(dir, "vol-data.img"))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = f.ReadAt(label, 1024+0x78)
	f.Close()
	if got := string(bytes.TrimRight(label, "\x00")); got != guestinit.VolumeLabel {
		t.Errorf("the mounted disk's label is %q", got)
	}
	raw, _ := os.ReadFile(filepath.Join(dir, "vol-raw.img"))
	if len(raw) != 16<<20 || !bytes.Equal(raw[:1<<20], make([]byte, 1<<20)) {
		t.Errorf("the raw disk: %d bytes, not zeros", len(raw))
	}
	info := v.Guest.Volumes[2]
	want := []guestinit.File{
		{Path: "labels", Mode: 0o600, Data: []byte("a=\"q\\\"uote\"\nb=\"2\"\n")},
		{Path: "ns", Mode: 0o444, Data: []byte("ns")},
		{Path: "note", Mode: 0o600, Data: []byte("x")},
	}
	for i := range want {
		if i >= len(info.Files) || info.Files[i].Path != want[i].Path || info.Files[i].Mode != want[i].Mode || !bytes.Equal(info.Files[i].Data, want[i].Data) {
			t.Errorf("downwardAPI files %+v, want %+v", info.Files, want)
			break
		}
	}
	if len(v.Guest.Mounts) != 2 || !v.Guest.Mounts[1].ReadOnly || len(v.Guest.Devices) != 1 || v.Guest.Devices[0].Path != "/dev/raw0" {
		t.Errorf("mounts %+v devices %+v", v.Guest.Mounts, v.Guest.Devices)
	}

	// Made again: the disks are what the guest left.
	if err := os.WriteFile(filepath.Join(dir, "vol-raw.img"), []byte("written"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Make(&vmrun.Run{VM: vm, Dir: dir}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "vol-raw.img")); string(b) != "written" {
		t.Errorf("the disk was made anew: %d bytes", len(b))
	}
	if err := Remove(dir, vm); err != nil {
		t.Fatal(err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "vol-*")); len(left) != 0 {
		t.Errorf("left after Remove: %v", left)
	}
}
