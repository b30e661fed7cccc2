// Package testcluster gives tests a real Kubernetes API: etcd and kube-apiserver started through
// controller-runtime's envtest from locally built binaries, with IMP's CRDs installed.
//
// The binaries come from KUBEBUILDER_ASSETS when it is set, else from the cache that
// hack/setup-control-plane.sh fills ($IMP_CACHE/cp/bin, IMP_CACHE defaulting to ~/.cache/imp).
// Nothing is downloaded: a missing binary is an error that says which script to run.
package testcluster

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zapcore"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	impscheme "github.com/syscode-labs/imp/internal/scheme"
)

// Cluster is a running etcd + kube-apiserver with IMP's CRDs.
type Cluster struct {
	Env    *envtest.Environment
	Config *rest.Config
	Scheme *runtime.Scheme
	Client client.Client
}

// AssetsDir returns the directory holding etcd, kube-apiserver and kubectl.
func AssetsDir() (string, error) {
	dir := os.Getenv("KUBEBUILDER_ASSETS")
	if dir == "" {
		cache := os.Getenv("IMP_CACHE")
		if cache == "" {
			home, err := os.UserHomeDir()
			if err != nil {
				return "", fmt.Errorf("finding the control plane cache: %w", err)
			}
			cache = filepath.Join(home, ".cache", "imp")
		}
		dir = filepath.Join(cache, "cp", "bin")
	}
	for _, b := range []string{"etcd", "kube-apiserver", "kubectl"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			return "", fmt.Errorf("control plane binary %s not found in %s (run hack/setup-control-plane.sh, or set KUBEBUILDER_ASSETS): %w", b, dir, err)
		}
	}
	return dir, nil
}

// RepoRoot returns the directory holding the module's go.mod, found upwards from the working
// directory (go test runs each package in its own directory).
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("finding the repository root: %w", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("finding the repository root: no go.mod above the working directory")
		}
		dir = parent
	}
}

// Option adjusts the control plane before it starts.
type Option func(*envtest.Environment)

// WithoutCRDs starts the control plane without IMP's CRDs, for tests that install them
// themselves (kubectl apply, helm install).
func WithoutCRDs() Option {
	return func(e *envtest.Environment) { e.CRDDirectoryPaths = nil }
}

// Start starts a control plane and installs the CRDs under config/crd/bases.
func Start(opts ...Option) (*Cluster, error) {
	assets, err := AssetsDir()
	if err != nil {
		return nil, err
	}
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	env := &envtest.Environment{
		BinaryAssetsDirectory:    assets,
		CRDDirectoryPaths:        []string{filepath.Join(root, "config", "crd", "bases")},
		ErrorIfCRDPathMissing:    true,
		ControlPlaneStartTimeout: 2 * time.Minute,
	}
	for _, o := range opts {
		o(env)
	}
	// Test data need not survive a power cut; fsync dominates etcd's latency on a small VM.
	env.ControlPlane.Etcd = &envtest.Etcd{}
	env.ControlPlane.Etcd.Configure().Append("unsafe-no-fsync", "true")
	cfg, err := env.Start()
	if err != nil {
		return nil, fmt.Errorf("starting etcd and kube-apiserver from %s: %w", assets, err)
	}
	cfg.QPS, cfg.Burst = 500, 1000
	s, err := impscheme.New()
	if err != nil {
		_ = env.Stop()
		return nil, err
	}
	c, err := client.New(cfg, client.Options{Scheme: s})
	if err != nil {
		_ = env.Stop()
		return nil, fmt.Errorf("creating a client: %w", err)
	}
	return &Cluster{Env: env, Config: cfg, Scheme: s, Client: c}, nil
}

// Stop stops the control plane.
func (c *Cluster) Stop() error { return c.Env.Stop() }

// Main is a TestMain body: it starts a control plane into *c, runs the tests and stops it.
// Under -short no control plane is started and Require skips the tests that need one.
func Main(m *testing.M, c **Cluster, opts ...Option) int {
	flag.Parse()
	// Components under test log through controller-runtime; keep errors, drop the chatter.
	ctrllog.SetLogger(zap.New(zap.WriteTo(os.Stderr), zap.Level(zapcore.ErrorLevel)))
	if testing.Short() {
		return m.Run()
	}
	cl, err := Start(opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testcluster:", err)
		return 1
	}
	*c = cl
	code := m.Run()
	if err := cl.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "testcluster: stopping:", err)
	}
	return code
}

// Require returns c, or skips the test when no control plane was started (-short).
func Require(t testing.TB, c *Cluster) *Cluster {
	t.Helper()
	if c == nil {
		t.Skip("needs a control plane; not started under -short")
	}
	return c
}

var nonName = regexp.MustCompile(`[^a-z0-9-]+`)

// Namespace creates a namespace of its own for the test and deletes it when the test ends.
func (c *Cluster) Namespace(t testing.TB) string {
	t.Helper()
	base := strings.Trim(nonName.ReplaceAllString(strings.ToLower(t.Name()), "-"), "-")
	if len(base) > 40 {
		base = base[:40]
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: base + "-" + rand.String(5)}}
	ctx := context.Background()
	if err := c.Client.Create(ctx, ns); err != nil {
		t.Fatalf("creating namespace %s: %v", ns.Name, err)
	}
	t.Cleanup(func() { _ = c.Client.Delete(context.WithoutCancel(ctx), ns) })
	return ns.Name
}

// Kubectl runs the kubectl of the control plane's binaries with the given kubeconfig and
// returns its combined output.
func Kubectl(kubeconfig string, args ...string) (string, error) {
	assets, err := AssetsDir()
	if err != nil {
		return "", err
	}
	cmd := exec.Command(filepath.Join(assets, "kubectl"), append([]string{"--kubeconfig", kubeconfig}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// Kubeconfig writes a kubeconfig for a cluster-admin user into the test's temporary
// directory and returns its path.
func (c *Cluster) Kubeconfig(t testing.TB) string {
	t.Helper()
	user, err := c.Env.AddUser(envtest.User{Name: "admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatalf("adding an admin user: %v", err)
	}
	kc, err := user.KubeConfig()
	if err != nil {
		t.Fatalf("rendering a kubeconfig: %v", err)
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, kc, 0o600); err != nil {
		t.Fatalf("writing %s: %v", path, err)
	}
	return path
}
