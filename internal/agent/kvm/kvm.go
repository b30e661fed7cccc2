// Package kvm checks that a host's KVM can run guests.
package kvm

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// Device is where KVM lives.
const Device = "/dev/kvm"

// Check returns nil when the KVM device at path can run guests, else why not. Opening it is not
// enough: it must answer KVM_GET_API_VERSION with 12 and create a VM, and the host must not run
// kvm-pvm (pagetable-based nested virtualization), whose /dev/kvm passes both checks but fails
// microvm guests ("kvm-pvm: INTERNAL_ERROR in batch emul", seen on IMP's CI machines).
func Check(path string) error {
	if _, err := os.Stat("/sys/module/kvm_pvm"); err == nil && path == Device {
		return errors.New("the host runs kvm-pvm (module kvm_pvm), whose guests fail under microVM machines")
	}
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening %s: %w", path, err)
	}
	defer f.Close()
	const getAPIVersion, createVM = 0xAE00, 0xAE01
	v, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), getAPIVersion, 0)
	if errno != 0 {
		return fmt.Errorf("%s: KVM_GET_API_VERSION: %w", path, errno)
	}
	if v != 12 {
		return fmt.Errorf("%s: KVM API version %d, want 12", path, v)
	}
	vm, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), createVM, 0)
	if errno != 0 {
		return fmt.Errorf("%s: KVM_CREATE_VM: %w", path, errno)
	}
	syscall.Close(int(vm))
	return nil
}
