package vmm

// MemoryOverhead is the memory, in bytes, one VMM process of kind holds beyond its guest's
// RAM: placement counts it with every VM so that many small VMs cannot overrun a node.
//
//   - QEMU under TCG (software emulation): 120 MiB measured on IMP's development machines by
//     make bench-overhead (QEMU 7.2, guests of 128 and 512 MiB alike; about 60 MiB of it is
//     TCG's translation cache, which IMP bounds with tb-size), rounded up to 128 MiB.
//   - QEMU with KVM: no translation cache; the rest of the TCG figure, 60 MiB, rounded up to
//     64 MiB. Not measured on a KVM host yet (there is none here): make bench-overhead
//     prints it where KVM works.
//   - Firecracker: at most 5 MiB per its specification (SPECIFICATION.md of v1.16.1, "memory
//     overhead <= 5 MiB"), plus 3 MiB for the jailer's and the API's buffers: 8 MiB.
func MemoryOverhead(kind, accel string) int64 {
	switch {
	case kind == "firecracker":
		return 8 << 20
	case accel == "kvm":
		return 64 << 20
	default:
		return 128 << 20
	}
}
