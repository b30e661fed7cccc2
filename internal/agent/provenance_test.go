package agent_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/testguest"
	"github.com/syscode-labs/imp/internal/testregistry"
)

// TestAnotherTenantsPrivateImage: tenant A runs a private image, pulled with its Secret, so its
// base disk is on the node. Tenant B, in another namespace, names the same digest at a
// registry of its own that answers every manifest request with that digest (and A's manifest
// and config, as if they had leaked), by digest and by a tag: both of B's VMs fail with
// ImagePullFailed, and no VMM of B's ever starts on A's disk.
func TestAnotherTenantsPrivateImage(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	g := NewWithT(t)
	private := testregistry.Start(t, "puller", "s3cret")
	auth := base64.StdEncoding.EncodeToString([]byte("puller:s3cret"))
	dockerConfig := fmt.Sprintf(`{"auths":{"http://%s/v2/":{"auth":%q}}}`, private, auth)
	kc, err := disk.NewPullSecretKeychain([]byte(dockerConfig))
	if err != nil {
		t.Fatal(err)
	}
	d := testguest.ImageAs(t, private, "private", kc)
	secret := &corev1.Secret{Type: corev1.SecretTypeDockerConfigJson, StringData: map[string]string{corev1.DockerConfigJsonKey: dockerConfig}}
	secret.Namespace, secret.Name = w.ns, "pull"
	if err := w.c.Client.Create(ctx, secret); err != nil {
		t.Fatal(err)
	}
	owner := w.vm("owner", "serve")
	owner.Spec.Image = private + "/private:v1"
	owner.Spec.ImagePullSecrets = []corev1.LocalObjectReference{{Name: "pull"}}
	if err := w.c.Client.Create(ctx, owner); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.VMPhase { return w.get("owner").Status.Phase }).WithTimeout(9*time.Minute).WithPolling(200*time.Millisecond).
		Should(Equal(impv1.VMRunning), func() string { return fmt.Sprintf("%+v", w.get("owner").Status) })

	impostor, asked := testregistry.StartImpostor(t, d, kc)
	other := w.c.Namespace(t)
	images := map[string]string{"by-digest": impostor + "/x@" + d.DigestStr(), "by-tag": impostor + "/x:latest"}
	for n, image := range images {
		vm := w.vm(n, "serve")
		vm.Namespace, vm.Spec.Image = other, image
		vm.Spec.RunStrategy = impv1.RunStrategyOnce
		if err := w.c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	get := func(n string) *impv1.ImpVM {
		v := &impv1.ImpVM{}
		if err := w.c.Client.Get(ctx, types.NamespacedName{Namespace: other, Name: n}, v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	for n := range images {
		g.Eventually(func() string {
			v := get(n)
			if v.Status.Phase == impv1.VMRunning {
				t.Fatalf("tenant B's VM %s runs on tenant A's image: %+v", n, v.Status)
			}
			if rt := v.Status.Runtime; rt != nil {
				return rt.Reason + ": " + rt.Message
			}
			return ""
		}).WithTimeout(3*time.Minute).WithPolling(100*time.Millisecond).Should(ContainSubstring("ImagePullFailed"), "VM %s", n)
		v := get(n)
		if !strings.Contains(v.Status.Runtime.Message, "does not serve the image's content") {
			t.Errorf("VM %s failed for another reason than the content: %s", n, v.Status.Runtime.Message)
		}
		if _, err := os.Stat(filepath.Join(w.stateDir, "vms", string(v.UID), "console.log")); err == nil {
			t.Errorf("VM %s has a console: its VMM started", n)
		}
	}
	if asked.Load() == 0 {
		t.Error("the impostor registry was never asked")
	}
}

// TestLoopbackRegistryIsRefused: a VM names an image at localhost:<port>, where a server of
// the node (a stand-in for the kubelet's read-only port, an exporter) answers every request
// with its secrets. The agent, whose flags name only the tests' registry address, refuses to
// dial it: the VM fails with ImagePullFailed, and nothing the server said is in its status.
func TestLoopbackRegistryIsRefused(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	var asked atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		asked.Add(1)
		rw.WriteHeader(http.StatusNotFound)
		_, _ = io.WriteString(rw, "node-secret-token: s3cr3t\x1b[2J")
	}))
	t.Cleanup(srv.Close)
	port := srv.URL[strings.LastIndex(srv.URL, ":")+1:]
	vm := w.vm("peek")
	vm.Spec.Image = "localhost:" + port + "/x:y"
	vm.Spec.RunStrategy = impv1.RunStrategyOnce
	if err := w.c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	g.Eventually(func() string {
		if rt := w.get("peek").Status.Runtime; rt != nil {
			return rt.Reason + ": " + rt.Message
		}
		return ""
	}).WithTimeout(3 * time.Minute).WithPolling(100 * time.Millisecond).Should(ContainSubstring("ImagePullFailed"))
	msg := w.get("peek").Status.Runtime.Message
	if strings.Contains(msg, "s3cr3t") || strings.Contains(msg, "\x1b") {
		t.Errorf("the local server's answer reached the VM's status: %q", msg)
	}
	if !strings.Contains(msg, "loopback or link-local") {
		t.Errorf("refused for another reason: %q", msg)
	}
	if asked.Load() != 0 {
		t.Errorf("the local server was asked %d times", asked.Load())
	}
}
