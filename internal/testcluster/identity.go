package testcluster

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/releaseutil"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"
)

// ChartNamespace is the namespace the chart's identities live in, in tests as in the runbook.
const ChartNamespace = "imp-system"

// The chart's components, by their ServiceAccount's name.
const (
	Operator = "imp-operator"
	Agent    = "imp-agent"
)

// rbacKinds are the kinds of the chart's manifests that make up its components' authority.
var rbacKinds = map[string]bool{"ServiceAccount": true, "ClusterRole": true, "ClusterRoleBinding": true, "Role": true, "RoleBinding": true}

var rbacOnce sync.Map // *Cluster → *onceErr

type onceErr struct {
	once sync.Once
	err  error
}

// As returns a client configuration that acts as component's ServiceAccount ("imp-operator",
// "imp-agent") with exactly the authority the chart gives it: the chart's ServiceAccounts,
// roles and bindings, rendered from charts/imp with default values by Helm's own engine, are
// installed once per cluster, and the configuration impersonates the ServiceAccount with the
// groups its token would carry. Components under test use it instead of the cluster admin.
func (c *Cluster) As(t testing.TB, component string) *rest.Config {
	t.Helper()
	cfg, err := c.ConfigAs(component, "")
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// ConfigAs is As outside a test; a node, when not empty, is the identity's node claim (see
// AsNode).
func (c *Cluster) ConfigAs(component, node string) (*rest.Config, error) {
	if err := c.installChartRBAC(); err != nil {
		return nil, fmt.Errorf("installing the chart's RBAC: %w", err)
	}
	cfg := rest.CopyConfig(c.Config)
	cfg.Impersonate = impersonation(component)
	if node != "" {
		cfg.Impersonate.Extra = map[string][]string{NodeNameClaim: {node}}
	}
	return cfg, nil
}

// KubeconfigAs writes a kubeconfig that acts as component's ServiceAccount (see As), for
// components run as processes, and returns its path. A node, when given, is the node claim of
// the identity (see AsNode).
func (c *Cluster) KubeconfigAs(t testing.TB, component string, node ...string) string {
	t.Helper()
	path, err := c.WriteKubeconfigAs(t.TempDir(), component, node...)
	if err != nil {
		t.Fatal(err)
	}
	return path
}

// WriteKubeconfigAs is KubeconfigAs outside a test: it writes the kubeconfig into dir.
func (c *Cluster) WriteKubeconfigAs(dir, component string, node ...string) (string, error) {
	if err := c.installChartRBAC(); err != nil {
		return "", fmt.Errorf("installing the chart's RBAC: %w", err)
	}
	user, err := c.Env.AddUser(envtest.User{Name: "impersonator", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return "", fmt.Errorf("adding a user: %w", err)
	}
	raw, err := user.KubeConfig()
	if err != nil {
		return "", fmt.Errorf("rendering a kubeconfig: %w", err)
	}
	kc, err := clientcmd.Load(raw)
	if err != nil {
		return "", fmt.Errorf("reading the kubeconfig: %w", err)
	}
	imp := impersonation(component)
	for _, a := range kc.AuthInfos {
		a.Impersonate, a.ImpersonateGroups = imp.UserName, imp.Groups
		if len(node) > 0 {
			a.ImpersonateUserExtra = map[string][]string{NodeNameClaim: node}
		}
	}
	path := filepath.Join(dir, component+".kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		return "", fmt.Errorf("writing %s: %w", path, err)
	}
	return path, nil
}

// AsNode is As for a component bound to a node (the agent): its identity carries the node claim
// a token bound to the node's pod carries (authentication.kubernetes.io/node-name).
func (c *Cluster) AsNode(t testing.TB, component, node string) *rest.Config {
	t.Helper()
	cfg, err := c.ConfigAs(component, node)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// NodeNameClaim is the user extra that names the node of a token bound to a pod.
const NodeNameClaim = "authentication.kubernetes.io/node-name"

func impersonation(component string) rest.ImpersonationConfig {
	return rest.ImpersonationConfig{
		UserName: "system:serviceaccount:" + ChartNamespace + ":" + component,
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + ChartNamespace, "system:authenticated"},
	}
}

func (c *Cluster) installChartRBAC() error {
	v, _ := rbacOnce.LoadOrStore(c, &onceErr{})
	o := v.(*onceErr)
	o.once.Do(func() { o.err = c.applyChart(context.Background(), rbacKinds) })
	return o.err
}

// InstallChartObjects creates the chart's objects (rendered with default values) of the given
// kinds, such as its admission policies.
func (c *Cluster) InstallChartObjects(t testing.TB, kinds ...string) {
	t.Helper()
	if err := c.ApplyChartObjects(context.Background(), kinds...); err != nil {
		t.Fatal(err)
	}
}

// WaitForMutation waits, up to 30 s, until mutated says that a dry-run create, which it makes,
// was mutated by a mutating admission policy just installed. The API server loads a new policy
// within a few seconds, and until its mutating policies have fetched the schema of the kind
// they mutate (they poll the OpenAPI paths every 5 s) it refuses creates of that kind with
// 503, whatever the policy's failurePolicy: see docs/operator.md.
func WaitForMutation(t testing.TB, mutated func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ok, err := mutated()
		if err != nil && !apierrors.IsServiceUnavailable(err) {
			t.Fatalf("creating (dry run): %v", err)
		}
		if err == nil && ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("a create 30 s after the policy was installed: mutated %v, error %v", ok, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// ApplyChartObjects is InstallChartObjects outside a test.
func (c *Cluster) ApplyChartObjects(ctx context.Context, kinds ...string) error {
	want := map[string]bool{}
	for _, k := range kinds {
		want[k] = true
	}
	if err := c.applyChart(ctx, want); err != nil {
		return fmt.Errorf("installing the chart's %v: %w", kinds, err)
	}
	return nil
}

func (c *Cluster) applyChart(ctx context.Context, kinds map[string]bool) error {
	root, err := RepoRoot()
	if err != nil {
		return err
	}
	docs, err := ChartManifests(filepath.Join(root, "charts", "imp"), nil)
	if err != nil {
		return err
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ChartNamespace}}
	if err := c.Client.Create(ctx, ns); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating namespace %s: %w", ChartNamespace, err)
	}
	objs := make([]*unstructured.Unstructured, 0, len(docs))
	for _, doc := range docs {
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal([]byte(doc), &u.Object); err != nil {
			return fmt.Errorf("parsing a chart manifest: %w", err)
		}
		objs = append(objs, u)
	}
	// The chart's own namespaces first, as Helm installs them: its objects may live there.
	for _, u := range objs {
		if u.GetKind() == "Namespace" {
			if err := c.Client.Create(ctx, u.DeepCopy()); err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("creating namespace %s: %w", u.GetName(), err)
			}
		}
	}
	n := 0
	for _, u := range objs {
		if !kinds[u.GetKind()] {
			continue
		}
		if err := c.Client.Create(ctx, u); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("creating %s %s: %w", u.GetKind(), u.GetName(), err)
		}
		n++
	}
	if n == 0 {
		return fmt.Errorf("the chart rendered none of %v", kinds)
	}
	return nil
}

// ChartManifests renders the chart in dir with values (nil: its defaults) as an install into
// ChartNamespace, with Helm's own engine, and returns its manifests. It renders for a cluster
// with the APIs of the control plane the tests run (Kubernetes 1.37): Helm's defaults, plus
// the kinds the chart asks the cluster for.
func ChartManifests(dir string, values map[string]any) ([]string, error) {
	ch, err := loader.Load(dir)
	if err != nil {
		return nil, fmt.Errorf("loading the chart %s: %w", dir, err)
	}
	caps := *chartutil.DefaultCapabilities
	caps.APIVersions = append(slices.Clone(caps.APIVersions), "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")
	rv, err := chartutil.ToRenderValues(ch, values, chartutil.ReleaseOptions{Name: "imp", Namespace: ChartNamespace, IsInstall: true}, &caps)
	if err != nil {
		return nil, fmt.Errorf("values of the chart: %w", err)
	}
	files, err := engine.Render(ch, rv)
	if err != nil {
		return nil, fmt.Errorf("rendering the chart: %w", err)
	}
	var out []string
	for name, content := range files {
		if !strings.HasSuffix(name, ".yaml") {
			continue
		}
		for _, doc := range releaseutil.SplitManifests(content) {
			if strings.TrimSpace(doc) != "" {
				out = append(out, doc)
			}
		}
	}
	return out, nil
}
