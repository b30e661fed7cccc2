// Command disk benchmarks the agent's disk path: a cold image (pulled from a registry on
// 127.0.0.1, layers applied, ext4 built) to a base disk in MB/s of image content, and the disk
// preparation of a second VM of the same image (base present, its own writable disk).
//
//	go run ./test/bench/disk -mb 64 -runs 3      (make bench-disk)
package main

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/guestinit"
)

func main() {
	mb := flag.Int("mb", 64, "image content in MiB (incompressible files over 3 layers)")
	runs := flag.Int("runs", 3, "runs")
	flag.Parse()
	if err := run(*mb, *runs); err != nil {
		fmt.Fprintln(os.Stderr, "bench-disk:", err)
		os.Exit(1)
	}
}

func run(mb, runs int) error {
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	var cold, second, writable []time.Duration
	for r := 0; r < runs; r++ {
		img, err := image(mb)
		if err != nil {
			return err
		}
		ref, err := name.ParseReference(fmt.Sprintf("%s/bench:%d", host, r), name.Insecure)
		if err != nil {
			return err
		}
		if err := remote.Write(ref, img); err != nil {
			return err
		}
		dg, _ := img.Digest()
		d := ref.Context().Digest(dg.String())
		dir, err := os.MkdirTemp("", "bench-disk")
		if err != nil {
			return err
		}
		store := &disk.BaseStore{Dir: filepath.Join(dir, "images"), MaxBytes: 1 << 40}
		kc := disk.PullSecretKeychain{}
		t0 := time.Now()
		if _, _, err := store.Ensure(context.Background(), "bench", d, kc); err != nil {
			return err
		}
		cold = append(cold, time.Since(t0))
		// The first VM of a disk size makes that size's template (mkfs, once).
		w := &disk.Writables{Dir: filepath.Join(dir, "templates")}
		if err := w.Ensure(filepath.Join(dir, "vm1.ext4"), 1<<30); err != nil {
			return err
		}
		t1 := time.Now()
		if _, _, err := store.Ensure(context.Background(), "bench", d, kc); err != nil {
			return err
		}
		t2 := time.Now()
		if err := w.Ensure(filepath.Join(dir, "vm2.ext4"), 1<<30); err != nil {
			return err
		}
		writable = append(writable, time.Since(t2))
		if err := disk.WriteConfig(filepath.Join(dir, "vm2.config"), guestinit.Config{Argv: []string{"/bin/app"}}); err != nil {
			return err
		}
		second = append(second, time.Since(t1))
		os.RemoveAll(dir)
	}
	med := func(ds []time.Duration) time.Duration {
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
		return ds[len(ds)/2]
	}
	c := med(cold)
	fmt.Printf("disk benchmark: %d MiB image (3 layers, incompressible), %d runs, medians\n", mb, runs)
	fmt.Printf("  cold image → base disk     %v  (%.0f MB/s of image content: pull, verify, apply layers, mkfs.ext4 -d)\n", c.Round(time.Millisecond), float64(mb)*1.048576/c.Seconds())
	fmt.Printf("  second VM disk preparation %v  (base disk present; 1Gi writable disk with its config)\n", med(second).Round(time.Millisecond))
	fmt.Printf("  of which the writable disk %v  (a copy of the 1Gi template, synced; no mkfs)\n", med(writable).Round(100*time.Microsecond))
	return nil
}

// image makes an image of mb MiB of random files in 3 layers.
func image(mb int) (v1.Image, error) {
	img := empty.Image
	per := mb / 3
	for l := 0; l < 3; l++ {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		for f := 0; f < per; f++ {
			data := make([]byte, 1<<20)
			_, _ = rand.Read(data)
			if err := tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("data/l%d/f%03d", l, f), Mode: 0o644, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
				return nil, err
			}
			if _, err := tw.Write(data); err != nil {
				return nil, err
			}
		}
		if err := tw.Close(); err != nil {
			return nil, err
		}
		b := buf.Bytes()
		layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
		if err != nil {
			return nil, err
		}
		if img, err = mutate.AppendLayers(img, layer); err != nil {
			return nil, err
		}
	}
	return img, nil
}
