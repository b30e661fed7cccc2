package main

import (
	"archive/tar"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// file is one file of an image layer: src on this machine, dst in the image.
type file struct {
	src, dst string
	mode     int64
}

// epoch stamps every layer entry, so that the same inputs give the same digests.
var epoch = time.Unix(0, 0)

// pushIMPImages builds and pushes IMP's two images to registry with tag and prints
// "repository@digest" for each:
//
//	imp-operator  the static operator binary, run as uid 65532, nothing else
//	imp-agent     agentRootfs (Debian with QEMU and e2fsprogs: hack/agent-rootfs.sh), the
//	              static agent binary and IMP's guest initramfs
func pushIMPImages(registry, tag, operator, agent, initrd, agentRootfs string) error {
	opLayer, err := filesLayer([]file{{operator, "usr/local/bin/imp-operator", 0o755}},
		map[string]string{"etc/passwd": "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
			"etc/group": "root:x:0:\nnonroot:x:65532:\n"})
	if err != nil {
		return err
	}
	base, err := dirLayer(agentRootfs)
	if err != nil {
		return err
	}
	agLayer, err := filesLayer([]file{{agent, "usr/local/bin/imp-agent", 0o755}, {initrd, "usr/share/imp/initramfs.cpio.gz", 0o644}}, nil)
	if err != nil {
		return err
	}
	for _, img := range []struct {
		repo   string
		layers []v1.Layer
		cfg    v1.Config
	}{
		{"imp-operator", []v1.Layer{opLayer}, v1.Config{Entrypoint: []string{"/usr/local/bin/imp-operator"}, User: "65532:65532",
			Env: []string{"PATH=/usr/local/bin"}}},
		{"imp-agent", []v1.Layer{base, agLayer}, v1.Config{Entrypoint: []string{"/usr/local/bin/imp-agent"},
			Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}}},
	} {
		i, err := mutate.AppendLayers(empty.Image, img.layers...)
		if err != nil {
			return err
		}
		img.cfg.Labels = map[string]string{"org.opencontainers.image.source": "https://github.com/syscode-labs/imp", "org.opencontainers.image.version": tag}
		cf, err := i.ConfigFile()
		if err != nil {
			return err
		}
		cf = cf.DeepCopy()
		cf.Config, cf.OS, cf.Architecture, cf.Created = img.cfg, "linux", "amd64", v1.Time{Time: epoch}
		if i, err = mutate.ConfigFile(i, cf); err != nil {
			return err
		}
		ref, err := name.ParseReference(registry+"/"+img.repo+":"+tag, name.Insecure)
		if err != nil {
			return err
		}
		if err := remote.Write(ref, i); err != nil {
			return fmt.Errorf("pushing %s: %w", ref, err)
		}
		d, err := i.Digest()
		if err != nil {
			return err
		}
		fmt.Printf("%s=%s@%s\n", img.repo, ref.Context(), d)
	}
	return nil
}

// pushOSImage pushes an OS-mode image (hack/os-image.sh): root as one layer, /sbin/init its
// entrypoint; it prints the digest reference.
func pushOSImage(refStr, root string) error {
	ref, err := name.ParseReference(refStr, name.Insecure)
	if err != nil {
		return err
	}
	layer, err := dirLayer(root)
	if err != nil {
		return err
	}
	i, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return err
	}
	cf, err := i.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	cf.Config = v1.Config{Entrypoint: []string{"/sbin/init"}, Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}}
	cf.OS, cf.Architecture, cf.Created = "linux", "amd64", v1.Time{Time: epoch}
	if i, err = mutate.ConfigFile(i, cf); err != nil {
		return err
	}
	if err := remote.Write(ref, i); err != nil {
		return fmt.Errorf("pushing %s: %w", ref, err)
	}
	d, err := i.Digest()
	if err != nil {
		return err
	}
	fmt.Printf("%s@%s\n", ref.Context(), d)
	return nil
}

// filesLayer is a layer of files copied from this machine and of literal contents.
func filesLayer(files []file, literal map[string]string) (v1.Layer, error) {
	tmp, err := os.CreateTemp("", "imp-layer-*.tar")
	if err != nil {
		return nil, err
	}
	defer tmp.Close()
	tw := tar.NewWriter(tmp)
	dirs := map[string]bool{}
	mkdirs := func(p string) error {
		var parents []string
		for d := filepath.Dir(p); d != "." && !dirs[d]; d = filepath.Dir(d) {
			parents = append([]string{d}, parents...)
			dirs[d] = true
		}
		for _, d := range parents {
			if err := tw.WriteHeader(&tar.Header{Name: d + "/", Mode: 0o755, Typeflag: tar.TypeDir, ModTime: epoch}); err != nil {
				return err
			}
		}
		return nil
	}
	for _, f := range files {
		data, err := os.ReadFile(f.src)
		if err != nil {
			return nil, err
		}
		if err := mkdirs(f.dst); err != nil {
			return nil, err
		}
		if err := tw.WriteHeader(&tar.Header{Name: f.dst, Mode: f.mode, Size: int64(len(data)), Typeflag: tar.TypeReg, ModTime: epoch}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	for dst, content := range literal {
		if err := mkdirs(dst); err != nil {
			return nil, err
		}
		if err := tw.WriteHeader(&tar.Header{Name: dst, Mode: 0o644, Size: int64(len(content)), Typeflag: tar.TypeReg, ModTime: epoch}); err != nil {
			return nil, err
		}
		if _, err := io.WriteString(tw, content); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return tarball.LayerFromFile(tmp.Name())
}

// dirLayer is a layer of a root filesystem directory: files, directories, symlinks and hard
// links with their modes and owners; sockets, pipes and devices are left out (a container
// runtime provides /dev). The compressed layer is kept beside the directory and reused while
// the directory's .imp-stamp is older.
func dirLayer(root string) (v1.Layer, error) {
	cached := filepath.Clean(root) + ".layer.tar.gz"
	if c, err := os.Stat(cached); err == nil {
		if st, err := os.Stat(filepath.Join(root, ".imp-stamp")); err == nil && c.ModTime().After(st.ModTime()) {
			return tarball.LayerFromFile(cached)
		}
	}
	tmp, err := os.CreateTemp(filepath.Dir(cached), ".layer-*.tar.gz")
	if err != nil {
		return nil, err
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	zw := gzip.NewWriter(tmp)
	tw := tar.NewWriter(zw)
	inodes := map[uint64]string{}
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		if !fi.Mode().IsRegular() && !fi.IsDir() && fi.Mode()&fs.ModeSymlink == 0 {
			return nil
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		hdr.Name, hdr.Uname, hdr.Gname = rel, "", ""
		hdr.ModTime, hdr.AccessTime, hdr.ChangeTime = epoch, time.Time{}, time.Time{}
		if fi.IsDir() {
			hdr.Name += "/"
		}
		st := fi.Sys().(*syscall.Stat_t)
		if fi.Mode().IsRegular() && st.Nlink > 1 {
			if first, ok := inodes[st.Ino]; ok {
				hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
				return tw.WriteHeader(hdr)
			}
			inodes[st.Ino] = rel
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			defer f.Close()
			if _, err := io.Copy(tw, f); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("archiving %s: %w", root, err)
	}
	if err := errors.Join(tw.Close(), zw.Close(), tmp.Close()); err != nil {
		return nil, err
	}
	if err := os.Rename(tmp.Name(), cached); err != nil {
		return nil, err
	}
	return tarball.LayerFromFile(cached)
}
