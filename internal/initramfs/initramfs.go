// Package initramfs builds the initramfs IMP boots every guest with: imp-init as /init and the
// kernel modules it loads (virtio transports, block, console, network, overlayfs), as a
// gzip-compressed newc cpio archive.
package initramfs

import (
	"compress/gzip"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// Modules are the kernel modules imp-init loads, in load order (dependencies first). A kernel
// that has one built in simply lacks its file; imp-init skips what is absent.
var Modules = []string{
	"kernel/drivers/virtio/virtio_ring.ko", // virtio needs its symbols
	"kernel/drivers/virtio/virtio.ko",
	"kernel/drivers/virtio/virtio_mmio.ko",
	"kernel/drivers/block/virtio_blk.ko",
	"kernel/drivers/char/virtio_console.ko",
	"kernel/net/core/failover.ko",
	"kernel/drivers/net/net_failover.ko",
	"kernel/drivers/net/virtio_net.ko",
	"kernel/fs/overlayfs/overlay.ko",
	"kernel/net/vmw_vsock/vsock.ko", // the guest channel under Firecracker
	"kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko",
	"kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko",
}

// OSModules are the modules an OS's init needs besides (ImpVM spec.boot OS: systemd mounts
// autofs and binfmt_misc file systems, cloud-init its seed), which imp-init loads in OS mode only, in the order of
// OSModuleOrderFile.
var OSModules = []string{
	"kernel/fs/autofs/autofs4.ko",
	"kernel/fs/binfmt_misc.ko",
	// cloud-init's NoCloud seed (spec.cloudInit): a vfat file system, mounted with the
	// kernel's default code page (437), character set (ascii) and utf8.
	"kernel/fs/nls/nls_cp437.ko",
	"kernel/fs/nls/nls_ascii.ko",
	"kernel/fs/nls/nls_utf8.ko",
	"kernel/fs/fat/fat.ko",
	"kernel/fs/fat/vfat.ko",
}

// ModuleDir is where the initramfs holds the modules; imp-init loads them in the order of
// ModuleOrderFile.
const (
	ModuleDir       = "lib/modules/imp"
	ModuleOrderFile = "lib/modules/imp/order"
	// OSModuleOrderFile lists OSModules, in load order.
	OSModuleOrderFile = "lib/modules/imp/os-order"
)

// Build writes the initramfs: init (a static binary) as /init and, from moduleRoot (a kernel's
// lib/modules/<version>), every file of Modules that exists.
func Build(w io.Writer, init string, moduleRoot string) error {
	zw := gzip.NewWriter(w)
	cw := &writer{w: zw, ino: 1}
	for _, d := range []string{"dev", "proc", "sys", "run", "tmp", "lib", "lib/modules", ModuleDir} {
		if err := cw.dir(d); err != nil {
			return err
		}
	}
	if err := cw.fileFrom("init", init, 0o755); err != nil {
		return err
	}
	for _, set := range []struct {
		file string
		list []string
	}{{ModuleOrderFile, Modules}, {OSModuleOrderFile, OSModules}} {
		file, list := set.file, set.list
		var order []string
		for _, m := range list {
			src := filepath.Join(moduleRoot, m)
			if _, err := os.Stat(src); err != nil {
				continue // built in, or not in this kernel
			}
			name := filepath.Base(m)
			if err := cw.fileFrom(ModuleDir+"/"+name, src, 0o644); err != nil {
				return err
			}
			order = append(order, name)
		}
		if err := cw.file(file, []byte(strings.Join(order, "\n")+"\n"), 0o644); err != nil {
			return err
		}
	}
	if err := cw.trailer(); err != nil {
		return err
	}
	return zw.Close()
}

// writer writes a newc ("070701") cpio archive.
type writer struct {
	w   io.Writer
	ino int
}

func (c *writer) header(name string, mode uint32, size int) error {
	c.ino++
	hdr := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		c.ino, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, len(name)+1, 0)
	if _, err := io.WriteString(c.w, hdr+name+"\x00"); err != nil {
		return err
	}
	return c.pad(len(hdr) + len(name) + 1)
}

func (c *writer) pad(n int) error {
	if r := n % 4; r != 0 {
		_, err := c.w.Write(make([]byte, 4-r))
		return err
	}
	return nil
}

func (c *writer) dir(name string) error { return c.header(name, 0o040755, 0) }

func (c *writer) file(name string, data []byte, perm uint32) error {
	if err := c.header(name, 0o100000|perm, len(data)); err != nil {
		return err
	}
	if _, err := c.w.Write(data); err != nil {
		return err
	}
	return c.pad(len(data))
}

func (c *writer) fileFrom(name, src string, perm uint32) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return fmt.Errorf("reading %s for the initramfs: %w", src, err)
	}
	return c.file(name, data, perm)
}

func (c *writer) trailer() error { return c.header("TRAILER!!!", 0, 0) }
