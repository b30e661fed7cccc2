// Command devtool does the build steps of the local environment and of IMP's images that need
// Go (no Docker engine anywhere):
//
//	devtool initramfs OUT IMP_INIT MODULES_DIR     write IMP's guest initramfs
//	devtool image REGISTRY/REPO:TAG BINARY ARGS...  push an image holding BINARY as /bin/app
//	devtool images REGISTRY TAG OPERATOR AGENT INITRAMFS AGENT_ROOTFS
//	                                               push imp-operator and imp-agent, print digests
//	devtool pause                                  a pod sandbox's process: sleep, reap, exit on TERM
//	devtool service-nat up|down ...                the local node's stand-in for kube-proxy
//	devtool agent-cert CA_CRT CA_KEY NODE DIR       an agent's access endpoint files, for make dev
//	devtool fetch URL N                             GET URL N times, print each answer's count (a pod's client)
//	devtool get URL                                 GET URL once, no retry, print the answer and its time
//	devtool resolve NAME                            print the addresses NAME resolves to
//	devtool -p DIR -s SIZE -m MODE -a create|delete local-path-provisioner's helper pod command
package main

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/syscode-labs/imp/internal/initramfs"
	"github.com/syscode-labs/imp/internal/testguest/reach"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "devtool:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	switch {
	case len(args) == 4 && args[0] == "initramfs":
		f, err := os.Create(args[1])
		if err != nil {
			return err
		}
		if err := initramfs.Build(f, args[2], args[3]); err != nil {
			return err
		}
		return f.Close()
	case len(args) >= 3 && args[0] == "image":
		return pushImage(args[1], args[2], args[3:])
	case len(args) == 7 && args[0] == "images":
		return pushIMPImages(args[1], args[2], args[3], args[4], args[5], args[6])
	case len(args) == 1 && args[0] == "pause":
		pause()
		return nil
	case len(args) >= 1 && args[0] == "service-nat":
		return serviceNAT(args[1:])
	case len(args) == 5 && args[0] == "agent-cert":
		return agentCert(args[1], args[2], args[3], args[4])
	case len(args) == 3 && args[0] == "os-image":
		return pushOSImage(args[1], args[2])
	case len(args) == 3 && args[0] == "fetch":
		return fetch(args[1], args[2])
	case len(args) == 2 && args[0] == "get":
		return get(args[1])
	case len(args) == 2 && args[0] == "resolve":
		return resolve(args[1])
	case len(args) >= 2 && args[0] == "-p":
		return localPathHelper(args)
	}
	if code, ok := reach.Main(os.Stdout, args); ok {
		if code != 0 {
			os.Exit(code)
		}
		return nil
	}
	return fmt.Errorf("usage: devtool serve NAME PORT... | devtool probe TIMEOUT TARGET... | devtool watch TARGET INTERVAL DURATION | devtool initramfs OUT IMP_INIT MODULES_DIR | devtool image REF BINARY [ARGS...] | devtool images REGISTRY TAG OPERATOR AGENT INITRAMFS AGENT_ROOTFS | devtool os-image REF ROOT_DIR | devtool pause | devtool service-nat up|down ... | devtool agent-cert CA_CRT CA_KEY NODE DIR | devtool fetch URL N | devtool get URL | devtool resolve NAME | devtool -p DIR -s SIZE -m MODE -a create|delete")
}

func pushImage(refStr, binary string, cmd []string) error {
	data, err := os.ReadFile(binary)
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range []struct {
		name string
		mode int64
		data []byte
	}{
		{"bin/app", 0o755, data},
		{"etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/bin/sh\n")},
	} {
		if err := tw.WriteHeader(&tar.Header{Name: f.name, Mode: f.mode, Size: int64(len(f.data)), Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		if _, err := tw.Write(f.data); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf.Bytes())), nil })
	if err != nil {
		return err
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	// A runtime refuses an image whose config names no platform.
	cf.Config, cf.OS, cf.Architecture = v1.Config{Entrypoint: []string{"/bin/app"}, Cmd: cmd, Env: []string{"PATH=/bin"}}, "linux", "amd64"
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return err
	}
	ref, err := name.ParseReference(refStr, name.Insecure)
	if err != nil {
		return err
	}
	if err := remote.Write(ref, img); err != nil {
		return fmt.Errorf("pushing %s: %w", ref, err)
	}
	d, _ := img.Digest()
	fmt.Printf("%s@%s\n", ref.Context(), d)
	return nil
}

// pause is the process of a pod sandbox of the local node (hack/real-node.sh): it holds the
// pod's namespaces, reaps what is reparented to it and exits on SIGINT or SIGTERM.
func pause() {
	c := make(chan os.Signal, 8)
	signal.Notify(c, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range c {
		if s != syscall.SIGCHLD {
			return
		}
		for {
			var ws syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
