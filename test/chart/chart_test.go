// Package chart_test renders the imp chart with Helm's own packages and checks each rule the
// chart promises: names, OnDelete, the imp/enabled selector that cannot be dropped, digests
// winning over tags, the schema refusing bad values, monitoring only where its API exists.
package chart_test

import (
	"reflect"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/releaseutil"
	"helm.sh/helm/v3/pkg/strvals"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"
)

const chartDir = "../../charts/imp"

func load(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// render renders the chart with --set style values and returns its manifests by "Kind/name".
func render(t *testing.T, caps *chartutil.Capabilities, sets ...string) (map[string]string, error) {
	t.Helper()
	c := load(t)
	vals := map[string]any{}
	for _, s := range sets {
		if err := strvals.ParseInto(s, vals); err != nil {
			t.Fatal(err)
		}
	}
	if caps == nil {
		caps = chartutil.DefaultCapabilities
	}
	rv, err := chartutil.ToRenderValues(c, vals, chartutil.ReleaseOptions{Name: "imp", Namespace: "imp-system", IsInstall: true}, caps)
	if err != nil {
		return nil, err
	}
	files, err := engine.Render(c, rv)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for name, content := range files {
		if strings.HasSuffix(name, "NOTES.txt") {
			out["NOTES"] = content
			continue
		}
		for _, doc := range releaseutil.SplitManifests(content) {
			var head struct {
				Kind     string
				Metadata struct{ Name string }
			}
			if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
				t.Fatalf("%s: %v\n%s", name, err, doc)
			}
			if head.Kind != "" {
				out[head.Kind+"/"+head.Metadata.Name] = doc
			}
		}
	}
	return out, nil
}

func mustRender(t *testing.T, sets ...string) map[string]string {
	t.Helper()
	m, err := render(t, nil, sets...)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func decode[T any](t *testing.T, doc string) *T {
	t.Helper()
	var v T
	if err := yaml.UnmarshalStrict([]byte(doc), &v); err != nil {
		t.Fatalf("%v\n%s", err, doc)
	}
	return &v
}

func TestLint(t *testing.T) {
	lint := action.NewLint()
	lint.Strict = true
	res := lint.Run([]string{chartDir}, map[string]any{})
	for _, m := range res.Messages {
		if m.Severity > 1 { // above INFO
			t.Errorf("lint: %s", m)
		}
	}
	for _, err := range res.Errors {
		t.Errorf("lint: %v", err)
	}
}

func TestDefaults(t *testing.T) {
	m := mustRender(t)
	var kinds []string
	for k := range m {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	t.Logf("objects: %v", kinds)

	ds := decode[appsv1.DaemonSet](t, m["DaemonSet/imp-runtime"])
	if ds.Namespace != "imp-system" || ds.Spec.UpdateStrategy.Type != appsv1.OnDeleteDaemonSetStrategyType {
		t.Errorf("DaemonSet imp-runtime in %q with updateStrategy %q, want imp-system and OnDelete", ds.Namespace, ds.Spec.UpdateStrategy.Type)
	}
	pod := ds.Spec.Template
	if pod.Labels["app.kubernetes.io/name"] != "imp-runtime" {
		t.Errorf("imp-runtime pods labelled %v", pod.Labels)
	}
	if got := pod.Spec.NodeSelector; len(got) != 1 || got["imp/enabled"] != "true" {
		t.Errorf("agent nodeSelector %v, want imp/enabled=true", got)
	}
	agent := pod.Spec.Containers[0]
	if agent.Image != "ghcr.io/syscode-labs/imp-agent:0.9.0" || !*agent.SecurityContext.Privileged || !pod.Spec.HostPID || !pod.Spec.HostNetwork {
		t.Errorf("agent image %s, privileged %v, hostPID %v, hostNetwork %v", agent.Image, *agent.SecurityContext.Privileged, pod.Spec.HostPID, pod.Spec.HostNetwork)
	}
	mounts := map[string]string{}
	for _, v := range agent.VolumeMounts {
		mounts[v.MountPath] = v.Name
	}
	for _, p := range []string{"/var/lib/imp", "/dev/kvm", "/dev/net/tun", "/sys/fs/cgroup", "/host/usr/local/bin", "/host/var/lib/imp/boot"} {
		if mounts[p] == "" {
			t.Errorf("the agent does not mount %s (mounts %v)", p, mounts)
		}
	}
	// Host artifacts never hide the image's own files: firecracker's directory on the host is
	// where imp-agent lives in the image.
	if mounts["/usr/local/bin"] != "" {
		t.Errorf("the agent mounts the host's /usr/local/bin over the image's, where imp-agent is")
	}
	args := strings.Join(agent.Args, " ")
	for _, want := range []string{"--overlay-address=$(HOST_IP)", "--kernel=/host/var/lib/imp/boot/vmlinuz", "--initramfs=/usr/share/imp/initramfs.cpio.gz",
		"--firecracker=/host/usr/local/bin/firecracker"} {
		if !strings.Contains(args, want) {
			t.Errorf("agent args lack %s: %s", want, args)
		}
	}

	dep := decode[appsv1.Deployment](t, m["Deployment/imp-operator"])
	op := dep.Spec.Template.Spec
	c := op.Containers[0]
	if c.Image != "ghcr.io/syscode-labs/imp-operator:0.9.0" || !*op.SecurityContext.RunAsNonRoot || *c.SecurityContext.AllowPrivilegeEscalation ||
		!*c.SecurityContext.ReadOnlyRootFilesystem || c.SecurityContext.Capabilities.Drop[0] != "ALL" || op.SecurityContext.SeccompProfile.Type != "RuntimeDefault" {
		t.Errorf("operator image %s or security context not restricted: %+v %+v", c.Image, op.SecurityContext, c.SecurityContext)
	}
	if strings.Contains(strings.Join(c.Args, " "), "pressure") {
		t.Errorf("pressure lifecycle on by default: %v", c.Args)
	}
	if c.LivenessProbe == nil || c.ReadinessProbe == nil || !strings.Contains(strings.Join(c.Args, " "), "--leader-elect=true") {
		t.Errorf("operator probes %v %v, args %v", c.LivenessProbe, c.ReadinessProbe, c.Args)
	}

	crds := 0
	for k, doc := range m {
		if strings.HasPrefix(k, "CustomResourceDefinition/") {
			crd := decode[apiextensionsv1.CustomResourceDefinition](t, doc)
			if crd.Annotations["helm.sh/resource-policy"] != "keep" {
				t.Errorf("%s is not kept on uninstall", k)
			}
			crds++
		}
	}
	if crds != 12 {
		t.Errorf("%d CRDs, want 12", crds)
	}
	for _, k := range []string{"ValidatingAdmissionPolicy/imp-quota", "ValidatingAdmissionPolicyBinding/imp-quota"} {
		if _, ok := m[k]; !ok {
			t.Errorf("%s not rendered by default", k)
		}
	}
	if off := mustRender(t, "quota.admissionPolicy.enabled=false"); off["ValidatingAdmissionPolicy/imp-quota"] != "" {
		t.Error("the quota admission policy rendered although disabled")
	}
	for _, k := range []string{"ServiceMonitor/imp-operator", "PrometheusRule/imp", "ConfigMap/imp-grafana-dashboard"} {
		if _, ok := m[k]; ok {
			t.Errorf("%s rendered although not enabled", k)
		}
	}
	role := decode[rbacv1.ClusterRole](t, m["ClusterRole/imp-view"])
	if role.Labels["rbac.authorization.k8s.io/aggregate-to-view"] != "true" || role.Rules[0].Verbs[0] != "get" {
		t.Errorf("imp-view %+v", role)
	}
	edit := decode[rbacv1.ClusterRole](t, m["ClusterRole/imp-edit"])
	if edit.Labels["rbac.authorization.k8s.io/aggregate-to-view"] != "" {
		t.Error("the view role would aggregate write access")
	}
}

// TestNodeSelectorsKeepTheOptIn: a user's selector is added to imp/enabled=true, never replaces it.
func TestNodeSelectorsKeepTheOptIn(t *testing.T) {
	for _, sets := range [][]string{
		{"agent.nodeSelector.pool=a"},
		{"agent.nodeSelector.pool=a", "agent.nodeSelector.imp/enabled=no"},
		{"agent.nodeSelector=null"},
	} {
		m := mustRender(t, sets...)
		ds := decode[appsv1.DaemonSet](t, m["DaemonSet/imp-runtime"])
		sel := ds.Spec.Template.Spec.NodeSelector
		if sel["imp/enabled"] != "true" {
			t.Errorf("%v: nodeSelector %v lost imp/enabled=true", sets, sel)
		}
		if strings.Contains(sets[0], "pool") && sel["pool"] != "a" {
			t.Errorf("%v: nodeSelector %v lost pool=a", sets, sel)
		}
	}
}

func TestDigestsPinImages(t *testing.T) {
	const op, ag = "sha256:1111111111111111111111111111111111111111111111111111111111111111", "sha256:2222222222222222222222222222222222222222222222222222222222222222"
	m := mustRender(t, "operator.image.digest="+op, "agent.image.digest="+ag, "agent.image.tag=ignored")
	dep := decode[appsv1.Deployment](t, m["Deployment/imp-operator"])
	ds := decode[appsv1.DaemonSet](t, m["DaemonSet/imp-runtime"])
	if got := dep.Spec.Template.Spec.Containers[0].Image; got != "ghcr.io/syscode-labs/imp-operator@"+op {
		t.Errorf("operator image %s", got)
	}
	if got := ds.Spec.Template.Spec.Containers[0].Image; got != "ghcr.io/syscode-labs/imp-agent@"+ag {
		t.Errorf("agent image %s", got)
	}
}

func TestSchemaRefusesBadValues(t *testing.T) {
	for _, tc := range []struct{ set, want string }{
		{"agent.bogus=1", "additional properties 'bogus' not allowed"},
		{"operator.replicas=two", "/operator/replicas"},
		{"agent.image.digest=sha256:abc", "/agent/image/digest"},
		{"logging.level=loud", "/logging/level"},
		{"pressureLifecycle.enabled=maybe", "/pressureLifecycle/enabled"},
		{"guest.kernel.sha256=xyz", "/guest/kernel/sha256"},
		{"agent.overlay.vxlanPort=70000", "/agent/overlay/vxlanPort"},
	} {
		if _, err := render(t, nil, tc.set); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("--set %s: %v, want an error naming %s", tc.set, err, tc.want)
		}
	}
}

func TestPressureLifecycleAndPins(t *testing.T) {
	const sum = "3333333333333333333333333333333333333333333333333333333333333333"
	m := mustRender(t, "pressureLifecycle.enabled=true", "guest.kernel.sha256="+sum, "firecracker.jailer.sha256="+sum)
	dep := decode[appsv1.Deployment](t, m["Deployment/imp-operator"])
	if args := strings.Join(dep.Spec.Template.Spec.Containers[0].Args, " "); !strings.Contains(args, "--pressure-lifecycle") {
		t.Errorf("operator args %s", args)
	}
	ds := decode[appsv1.DaemonSet](t, m["DaemonSet/imp-runtime"])
	args := strings.Join(ds.Spec.Template.Spec.Containers[0].Args, " ")
	if !strings.Contains(args, "--pin-kernel="+sum) || !strings.Contains(args, "--pin-jailer="+sum) || strings.Contains(args, "--pin-initramfs") {
		t.Errorf("agent args %s", args)
	}
}

func TestMonitoringOnlyWhereItsAPIExists(t *testing.T) {
	sets := []string{"metrics.serviceMonitor.enabled=true", "metrics.prometheusRule.enabled=true", "metrics.grafanaDashboard.enabled=true"}
	m := mustRender(t, sets...)
	if _, ok := m["ServiceMonitor/imp-operator"]; ok {
		t.Error("ServiceMonitor rendered without the monitoring.coreos.com API")
	}
	if _, ok := m["ConfigMap/imp-grafana-dashboard"]; !ok {
		t.Error("no dashboard ConfigMap")
	}
	caps := chartutil.DefaultCapabilities.Copy()
	caps.APIVersions = append(caps.APIVersions, "monitoring.coreos.com/v1")
	m, err := render(t, caps, sets...)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"ServiceMonitor/imp-operator", "ServiceMonitor/imp-runtime", "PrometheusRule/imp"} {
		if _, ok := m[k]; !ok {
			t.Errorf("%s not rendered with the API present", k)
		}
	}
	// The VMs' namespace label survives the scrape (not renamed exported_namespace).
	for _, k := range []string{"ServiceMonitor/imp-operator", "ServiceMonitor/imp-runtime"} {
		if !strings.Contains(m[k], "honorLabels: true") {
			t.Errorf("%s does not honor IMP's labels", k)
		}
	}
	if !strings.Contains(m["PrometheusRule/imp"], "alert: ImpVMMemoryNearlyFull") {
		t.Error("no alert for a VM near its memory")
	}
	m, err = render(t, caps, append(sets, "metrics.enabled=false")...)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"Service/imp-operator-metrics", "Service/imp-runtime-metrics", "ServiceMonitor/imp-operator", "PrometheusRule/imp", "ConfigMap/imp-grafana-dashboard"} {
		if _, ok := m[k]; ok {
			t.Errorf("%s rendered with metrics disabled", k)
		}
	}
}

// Where the finalizer policy is installed (its API exists), a post-install and post-upgrade
// Job waits until ImpVMs are admitted, with the operator's image and identity, unless
// admissionWait is off; it is neither where the API is missing.
func TestAdmissionWait(t *testing.T) {
	if _, ok := mustRender(t)["Job/imp-admission-wait"]; ok {
		t.Error("the admission wait rendered without the MutatingAdmissionPolicy API")
	}
	caps := chartutil.DefaultCapabilities.Copy()
	caps.APIVersions = append(caps.APIVersions, "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")
	m, err := render(t, caps, "operator.image.digest=sha256:"+strings.Repeat("a", 64))
	if err != nil {
		t.Fatal(err)
	}
	job, ok := m["Job/imp-admission-wait"]
	if !ok {
		t.Fatal("no admission wait Job with the MutatingAdmissionPolicy API")
	}
	for _, want := range []string{"helm.sh/hook: post-install,post-upgrade", "serviceAccountName: imp-operator", "@sha256:" + strings.Repeat("a", 64),
		"--wait-for-admission=180s", "--run-secret-namespace=imp-system", "runAsNonRoot: true"} {
		if !strings.Contains(job, want) {
			t.Errorf("the admission wait Job lacks %q:\n%s", want, job)
		}
	}
	if _, ok := m["MutatingAdmissionPolicy/imp-vm-finalizer"]; !ok {
		t.Error("no finalizer policy with its API")
	}
	m, err = render(t, caps, "admissionWait.enabled=false")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := m["Job/imp-admission-wait"]; ok {
		t.Error("the admission wait rendered with admissionWait.enabled=false")
	}
}

// The operator, which reads the Secrets ImpVMs reference and signs the agents' access, never
// runs on a node that runs VMs: by default its pods (and the Jobs with its identity) require
// imp/enabled not "true", added to each required node term the values give, and only
// operator.runOnVMNodes lifts it.
func TestOperatorOffVMNodes(t *testing.T) {
	caps := chartutil.DefaultCapabilities.Copy()
	caps.APIVersions = append(caps.APIVersions, "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")
	off := corev1.NodeSelectorRequirement{Key: "imp/enabled", Operator: corev1.NodeSelectorOpNotIn, Values: []string{"true"}}
	terms := func(t *testing.T, m map[string]string) map[string][]corev1.NodeSelectorTerm {
		t.Helper()
		out := map[string][]corev1.NodeSelectorTerm{}
		for _, k := range []string{"Deployment/imp-operator", "Job/imp-admission-wait"} {
			var spec corev1.PodSpec
			if k[0] == 'D' {
				spec = decode[appsv1.Deployment](t, m[k]).Spec.Template.Spec
			} else {
				spec = decode[batchv1.Job](t, m[k]).Spec.Template.Spec
			}
			if a := spec.Affinity; a != nil && a.NodeAffinity != nil && a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution != nil {
				out[k] = a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms
			} else {
				out[k] = nil
			}
		}
		return out
	}
	m, err := render(t, caps)
	if err != nil {
		t.Fatal(err)
	}
	for k, ts := range terms(t, m) {
		if len(ts) != 1 || !reflect.DeepEqual(ts[0].MatchExpressions, []corev1.NodeSelectorRequirement{off}) {
			t.Errorf("%s: required node terms %+v, want imp/enabled NotIn [true] alone", k, ts)
		}
	}
	// The values' own terms each get it, and their other affinities stay.
	zone := "operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
	m, err = render(t, caps, zone+"[0].matchExpressions[0].key=zone", zone+"[0].matchExpressions[0].operator=In", zone+"[0].matchExpressions[0].values[0]=a",
		zone+"[1].matchExpressions[0].key=zone", zone+"[1].matchExpressions[0].operator=In", zone+"[1].matchExpressions[0].values[0]=b",
		"operator.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=1",
		"operator.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].podAffinityTerm.topologyKey=kubernetes.io/hostname")
	if err != nil {
		t.Fatal(err)
	}
	for k, ts := range terms(t, m) {
		if len(ts) != 2 {
			t.Errorf("%s: required node terms %+v, want the values' two", k, ts)
			continue
		}
		for i, tm := range ts {
			if len(tm.MatchExpressions) != 2 || tm.MatchExpressions[0].Key != "zone" || !reflect.DeepEqual(tm.MatchExpressions[1], off) {
				t.Errorf("%s: term %d is %+v, want its zone and imp/enabled NotIn [true]", k, i, tm)
			}
		}
	}
	if a := decode[appsv1.Deployment](t, m["Deployment/imp-operator"]).Spec.Template.Spec.Affinity; a.PodAntiAffinity == nil {
		t.Error("the values' podAntiAffinity was lost")
	}
	m, err = render(t, caps, "operator.runOnVMNodes=true")
	if err != nil {
		t.Fatal(err)
	}
	for k, ts := range terms(t, m) {
		if ts != nil {
			t.Errorf("%s with operator.runOnVMNodes: required node terms %+v, want none", k, ts)
		}
	}
}

// TestTracing: off by default (no flag, no mount); on, both binaries get the collector, the
// protocol and the ratio, and the Secrets named are mounted where their flags point; the schema
// refuses an endpoint-less or malformed configuration.
func TestTracing(t *testing.T) {
	for _, name := range []string{"Deployment/imp-operator", "DaemonSet/imp-runtime"} {
		if strings.Contains(mustRender(t)[name], "tracing") {
			t.Errorf("%s mentions tracing by default", name)
		}
	}
	m := mustRender(t, "observability.tracing.enabled=true", "observability.tracing.endpoint=otel-collector.observability:4317",
		"observability.tracing.sampleRatio=0.25", "observability.tracing.caSecret=otel-ca", "observability.tracing.headersSecret=otel-token")
	dep := decode[appsv1.Deployment](t, m["Deployment/imp-operator"])
	ds := decode[appsv1.DaemonSet](t, m["DaemonSet/imp-runtime"])
	for name, spec := range map[string]corev1.PodSpec{"operator": dep.Spec.Template.Spec, "agent": ds.Spec.Template.Spec} {
		args := strings.Join(spec.Containers[0].Args, " ")
		for _, want := range []string{"--tracing-endpoint=otel-collector.observability:4317", "--tracing-protocol=grpc", "--tracing-sample-ratio=0.25",
			"--tracing-ca-file=/etc/imp/tracing-ca/ca.crt", "--tracing-headers-file=/etc/imp/tracing-headers/headers"} {
			if !strings.Contains(args, want) {
				t.Errorf("%s args lack %s: %s", name, want, args)
			}
		}
		mounts := map[string]string{}
		for _, vm := range spec.Containers[0].VolumeMounts {
			mounts[vm.Name] = vm.MountPath
		}
		secrets := map[string]string{}
		for _, v := range spec.Volumes {
			if v.Secret != nil {
				secrets[v.Name] = v.Secret.SecretName
			}
		}
		if mounts["tracing-ca"] != "/etc/imp/tracing-ca" || mounts["tracing-headers"] != "/etc/imp/tracing-headers" ||
			secrets["tracing-ca"] != "otel-ca" || secrets["tracing-headers"] != "otel-token" {
			t.Errorf("%s mounts %v, secret volumes %v", name, mounts, secrets)
		}
	}
	for _, tc := range []struct{ set, want string }{
		{"observability.tracing.enabled=true", "/observability/tracing/endpoint"},
		{"observability.tracing.sampleRatio=2", "/observability/tracing/sampleRatio"},
		{"observability.tracing.protocol=zipkin", "/observability/tracing/protocol"},
	} {
		if _, err := render(t, nil, tc.set); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("--set %s: %v, want an error naming %s", tc.set, err, tc.want)
		}
	}
}
