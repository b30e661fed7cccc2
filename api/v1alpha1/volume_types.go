package v1alpha1

import (
	"fmt"

	"k8s.io/apimachinery/pkg/api/resource"
)

// Volume is one of a VM's volumes, in the shape of a Pod's: its name, and exactly one source.
// A disk volume (emptyDisk) is a block device of the VM, mounted by imp-init (volumeMounts) or
// left raw at a device path (volumeDevices); a volume of files (secret, configMap,
// downwardAPI) is a read-only file system in the guest holding them, written anew at each run.
// See docs/volumes.md.
// +kubebuilder:validation:XValidation:rule="[has(self.persistentVolumeClaim), has(self.emptyDisk), has(self.secret), has(self.configMap), has(self.downwardAPI)].filter(x, x).size() == 1",message="set exactly one of persistentVolumeClaim, emptyDisk, secret, configMap and downwardAPI"
type Volume struct {
	// name of the volume, which volumeMounts and volumeDevices use: a DNS label.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	Name string `json:"name"`

	// persistentVolumeClaim is a PVC of the VM's namespace, attached by the kubelet of the VM's
	// node to a holder pod of the VM and handed to the VMM: a claim of volumeMode Block is a
	// disk of the VM; one of volumeMode Filesystem holds the disk's image, disk.img, made at
	// the claim's requested size on first use. Its data outlives the VM. A ReadWriteOnce claim
	// is never attached to two running VMs.
	// +optional
	PersistentVolumeClaim *PersistentVolumeClaimVolumeSource `json:"persistentVolumeClaim,omitempty"`

	// emptyDisk is an extra disk of the VM on its node, empty when the VM is placed and kept
	// across its runs there, gone with the placement (as the VM's own writable disk). Mounted
	// (volumeMounts), it holds an ext4 file system; named in volumeDevices, it is a raw
	// device of zeros. Its capacity counts against the node's disk and the namespace's
	// ImpQuota disk.
	// +optional
	EmptyDisk *EmptyDiskSource `json:"emptyDisk,omitempty"`

	// secret puts keys of a Secret of the VM's namespace into the guest as files, as a Pod's
	// secret volume does.
	// +optional
	Secret *SecretVolumeSource `json:"secret,omitempty"`

	// configMap puts keys of a ConfigMap of the VM's namespace into the guest as files, as a
	// Pod's configMap volume does.
	// +optional
	ConfigMap *ConfigMapVolumeSource `json:"configMap,omitempty"`

	// downwardAPI puts the VM's own name, namespace, uid, labels and annotations into the
	// guest as files, as a Pod's downwardAPI volume does.
	// +optional
	DownwardAPI *DownwardAPIVolumeSource `json:"downwardAPI,omitempty"`
}

// PersistentVolumeClaimVolumeSource names a PVC, as a Pod's does.
type PersistentVolumeClaimVolumeSource struct {
	// claimName is the PVC, of the VM's namespace.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	ClaimName string `json:"claimName"`
	// readOnly attaches the disk read-only.
	// +optional
	ReadOnly bool `json:"readOnly,omitempty"`
}

// EmptyDiskSource is an extra node-local disk.
type EmptyDiskSource struct {
	// capacity is the disk's size, a whole number of MiB, GiB or TiB (such as 512Mi or 2Gi)
	// from 16Mi to 16Ti.
	// +kubebuilder:validation:MaxLength=12
	// +kubebuilder:validation:Pattern=`^[1-9][0-9]{0,8}(Mi|Gi|Ti)$`
	// +kubebuilder:validation:XValidation:rule="quantity(self).compareTo(quantity('16Mi')) >= 0 && quantity(self).compareTo(quantity('16Ti')) <= 0",message="an emptyDisk's capacity must be from 16Mi to 16Ti"
	Capacity string `json:"capacity"`
}

// KeyToPath puts one key of a Secret or ConfigMap at a path of its volume.
type KeyToPath struct {
	// key of the Secret's or ConfigMap's data.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[-._a-zA-Z0-9]+$`
	Key string `json:"key"`
	// path of the file, relative to the volume: no element may be "..".
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=1024
	// +kubebuilder:validation:XValidation:rule="!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')",message="a volume's file path is relative and has no '..' element"
	Path string `json:"path"`
	// mode of the file (0 to 0777); the volume's defaultMode when unset.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=511
	Mode *int32 `json:"mode,omitempty"`
}

// SecretVolumeSource is a Secret's keys as files.
type SecretVolumeSource struct {
	// secretName is the Secret, of the VM's namespace.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	SecretName string `json:"secretName"`
	// items are the keys to put in the volume, each at its path; every key, at a path of its
	// name, when empty.
	// +optional
	// +kubebuilder:validation:MaxItems=64
	Items []KeyToPath `json:"items,omitempty"`
	// defaultMode is the files' mode (0 to 0777) when an item sets none: 0644 when unset.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=511
	DefaultMode *int32 `json:"defaultMode,omitempty"`
	// optional: a missing Secret (or key) leaves the volume empty (without the file) instead
	// of failing the run.
	// +optional
	Optional *bool `json:"optional,omitempty"`
}

// ConfigMapVolumeSource is a ConfigMap's keys as files.
type ConfigMapVolumeSource struct {
	// name of the ConfigMap, of the VM's namespace.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`
	// items are the keys to put in the volume, each at its path; every key (of data and
	// binaryData), at a path of its name, when empty.
	// +optional
	// +kubebuilder:validation:MaxItems=64
	Items []KeyToPath `json:"items,omitempty"`
	// defaultMode is the files' mode (0 to 0777) when an item sets none: 0644 when unset.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=511
	DefaultMode *int32 `json:"defaultMode,omitempty"`
	// optional: a missing ConfigMap (or key) leaves the volume empty (without the file)
	// instead of failing the run.
	// +optional
	Optional *bool `json:"optional,omitempty"`
}

// DownwardAPIVolumeSource is facts of the VM as files.
type DownwardAPIVolumeSource struct {
	// items are the files.
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=64
	Items []DownwardAPIVolumeFile `json:"items"`
	// defaultMode is the files' mode (0 to 0777) when an item sets none: 0644 when unset.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=511
	DefaultMode *int32 `json:"defaultMode,omitempty"`
}

// DownwardAPIVolumeFile is one file of a downwardAPI volume.
type DownwardAPIVolumeFile struct {
	// path of the file, relative to the volume: no element may be "..".
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=1024
	// +kubebuilder:validation:XValidation:rule="!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')",message="a volume's file path is relative and has no '..' element"
	Path string `json:"path"`
	// fieldRef selects what of the VM the file holds.
	FieldRef ObjectFieldSelector `json:"fieldRef"`
	// mode of the file (0 to 0777); the volume's defaultMode when unset.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=511
	Mode *int32 `json:"mode,omitempty"`
}

// ObjectFieldSelector selects a field of the VM, as a Pod's fieldRef does.
type ObjectFieldSelector struct {
	// fieldPath is metadata.name, metadata.namespace, metadata.uid, metadata.labels,
	// metadata.annotations (all of them, one key="value" per line, sorted), or
	// metadata.labels['KEY'] or metadata.annotations['KEY'] (one).
	// +kubebuilder:validation:MaxLength=330
	// +kubebuilder:validation:XValidation:rule="self in ['metadata.name', 'metadata.namespace', 'metadata.uid', 'metadata.labels', 'metadata.annotations'] || self.matches('^metadata[.](labels|annotations)\\\\[\\'[-._a-zA-Z0-9/]+\\'\\\\]$')",message="fieldPath must be metadata.name, metadata.namespace, metadata.uid, metadata.labels, metadata.annotations, metadata.labels['KEY'] or metadata.annotations['KEY']"
	FieldPath string `json:"fieldPath"`
}

// VolumeMount mounts a volume in the guest, as a container's volumeMount does.
type VolumeMount struct {
	// name of the volume (spec.volumes).
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	Name string `json:"name"`
	// mountPath is where, in the guest: an absolute path with no '.' or '..' element, not /
	// and not under /proc, /sys or /dev.
	// +kubebuilder:validation:MinLength=2
	// +kubebuilder:validation:MaxLength=1024
	// +kubebuilder:validation:XValidation:rule="self.startsWith('/') && !self.matches('(^|/)[.][.]?(/|$)') && !self.matches('^/+(proc|sys|dev)(/|$)') && self.matches('[^/]')",message="mountPath must be an absolute path with no '.' or '..' element, not / and not under /proc, /sys or /dev"
	MountPath string `json:"mountPath"`
	// readOnly mounts a disk volume read-only (a volume of files always is).
	// +optional
	ReadOnly bool `json:"readOnly,omitempty"`
	// subPath mounts one file or directory of a volume of files instead of the whole volume:
	// a relative path with no '..' element.
	// +optional
	// +kubebuilder:validation:MaxLength=1024
	// +kubebuilder:validation:XValidation:rule="!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')",message="subPath is relative and has no '..' element"
	SubPath string `json:"subPath,omitempty"`
}

// VolumeDevice puts a disk volume at a device path in the guest, raw, instead of mounting it.
type VolumeDevice struct {
	// name of the volume (spec.volumes), a disk volume.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	Name string `json:"name"`
	// devicePath is where, in the guest: an absolute path under /dev with no '..' element.
	// +kubebuilder:validation:MaxLength=1024
	// +kubebuilder:validation:XValidation:rule="self.matches('^/dev/[^/]') && !self.matches('(^|/)[.][.](/|$)')",message="devicePath must be a path under /dev with no '..' element"
	DevicePath string `json:"devicePath"`
}

// Bytes is the capacity in bytes; an error for one the API would refuse.
func (d *EmptyDiskSource) Bytes() (int64, error) {
	q, err := resource.ParseQuantity(d.Capacity)
	switch {
	case err != nil:
		return 0, fmt.Errorf("emptyDisk capacity %q: %w", d.Capacity, err)
	case q.Value() < 16<<20 || q.Value() > 16<<40 || q.Value()%(1<<20) != 0:
		return 0, fmt.Errorf("emptyDisk capacity %q is not a whole number of MiB from 16Mi to 16Ti", d.Capacity)
	}
	return q.Value(), nil
}

// Disk reports whether v is a disk volume (a block device of the VM) rather than files.
func (v *Volume) Disk() bool { return v.EmptyDisk != nil || v.PersistentVolumeClaim != nil }

// Claims are the PVCs the VM's volumes name.
func (s *ImpVMSpec) Claims() []string {
	var out []string
	for i := range s.Volumes {
		if c := s.Volumes[i].PersistentVolumeClaim; c != nil {
			out = append(out, c.ClaimName)
		}
	}
	return out
}

// VolumeHolderStatus is the pod that holds a VM's PVCs on its node: the kubelet attaches and
// mounts them for it, and the VM's agent hands them to the VMM from there.
type VolumeHolderStatus struct {
	// podName and podUID are the holder pod's, in the VM's namespace.
	PodName string `json:"podName"`
	PodUID  string `json:"podUID"`
	// containerID is the holder container's, as its runtime names it (containerd://ID): the
	// node's agent takes the claims from that container alone, never from another container
	// of the pod (an ephemeral one).
	// +optional
	ContainerID string `json:"containerID,omitempty"`
	// nodeName is the node it was made for (the VM's).
	NodeName string `json:"nodeName"`
	// ready: its volumes are attached (the pod runs), and the VM may start.
	// +optional
	Ready bool `json:"ready,omitempty"`
	// claims are the VM's claims as the holder holds them.
	// +optional
	Claims []HeldClaim `json:"claims,omitempty"`
	// message says what the holder waits for.
	// +optional
	Message string `json:"message,omitempty"`
}

// HeldClaim is a VM's PVC in its holder pod.
type HeldClaim struct {
	// volume is the VM's volume that names the claim.
	Volume string `json:"volume"`
	// block: the claim's volumeMode is Block (a device in the holder), else Filesystem (a
	// directory holding disk.img).
	// +optional
	Block bool `json:"block,omitempty"`
	// sizeBytes is the claim's requested size: a Filesystem claim's disk image is made at it.
	SizeBytes int64 `json:"sizeBytes"`
	// readOnly: the VM may only read the claim (its volume says readOnly, or the claim is
	// ReadOnlyMany alone).
	// +optional
	ReadOnly bool `json:"readOnly,omitempty"`
}

// Holder paths in the holder pod's container: a Filesystem claim's directory and a Block
// claim's device of volume NAME.
const (
	HolderMountDir  = "/imp/volumes"
	HolderDeviceDir = "/dev/imp"
)

// VolumeDiskSize is what the VM's disk volumes that IMP makes on its node take there: the sum
// of their capacities.
func (s *ImpVMSpec) VolumeDiskSize() resource.Quantity {
	var n int64
	for i := range s.Volumes {
		if d := s.Volumes[i].EmptyDisk; d != nil {
			b, _ := d.Bytes() // the API refuses what it cannot parse
			n += b
		}
	}
	return *resource.NewQuantity(n, resource.BinarySI)
}
