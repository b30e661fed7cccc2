package impvm_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/controller/volumeholder"
	"github.com/syscode-labs/imp/internal/testcluster"
)

// TestClaimsPlaceAndHold: a VM naming a PVC bound to a local volume of node a goes to node a
// (node b has more room); a holder pod, passing the namespace's restricted Pod Security, holds
// the claim there, and the VM waits VolumesNotReady until it runs. A second VM naming the
// ReadWriteOnce claim waits VolumeInUse, naming the first, and one naming a missing claim
// VolumeClaimNotFound. The first gone, the second is placed and gets a holder of its own.
func TestClaimsPlaceAndHold(t *testing.T) {
	e := newEnv(t)
	e.opts.VolumeHolderImage = "ghcr.io/syscode-labs/imp-operator:0.9.0" // the chart's default, which its policy names
	ctx := context.Background()
	hostname := func(n *corev1.Node) { n.Labels[corev1.LabelHostname] = n.Name }
	a := e.node("a", 8, 8, hostname)
	e.node("b", 16, 16, hostname)
	e.startAgent(nil)
	stop := e.startOperator()
	ns := &corev1.Namespace{}
	if err := e.c.Get(ctx, client.ObjectKey{Name: e.ns}, ns); err != nil {
		t.Fatal(err)
	}
	ns.Labels["pod-security.kubernetes.io/enforce"] = "restricted"
	if err := e.c.Update(ctx, ns); err != nil {
		t.Fatal(err)
	}
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: e.ns + "-data"}, Spec: corev1.PersistentVolumeSpec{
		Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
		AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
		PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
		StorageClassName:              "manual",
		PersistentVolumeSource:        corev1.PersistentVolumeSource{Local: &corev1.LocalVolumeSource{Path: "/mnt/data"}},
		NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
			MatchExpressions: []corev1.NodeSelectorRequirement{{Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{a.Name}}}}}}},
	}}
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "data"}, Spec: corev1.PersistentVolumeClaimSpec{
		AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
		StorageClassName: ptr.To("manual"), VolumeName: pv.Name,
		Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
	}}
	pv2, pvc2 := pv.DeepCopy(), pvc.DeepCopy()
	pv2.Name, pvc2.Name, pvc2.Spec.VolumeName = e.ns+"-data2", "data2", e.ns+"-data2"
	e.create(pv, pvc, pv2, pvc2)
	t.Cleanup(func() { _ = e.c.Delete(context.Background(), pv); _ = e.c.Delete(context.Background(), pv2) })
	withClaim := func(name, claim string) *impv1.ImpVM {
		vm := e.vm(name, 1, "1Gi")
		vm.Spec.Volumes = []impv1.Volume{{Name: "data", PersistentVolumeClaim: &impv1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}
		vm.Spec.VolumeMounts = []impv1.VolumeMount{{Name: "data", MountPath: "/data"}}
		return vm
	}
	reason := func(name string) string {
		v := e.get(name)
		if v == nil {
			return "gone"
		}
		for _, c := range v.Status.Conditions {
			if c.Status != metav1.ConditionTrue && c.Reason != "" {
				if strings.HasPrefix(c.Reason, "Volume") {
					return c.Reason + ": " + c.Message
				}
			}
		}
		return string(v.Status.Phase) + " on " + v.Status.NodeName
	}
	e.create(withClaim("first", "data"))
	eventually(t, func() string { return e.get("first").Status.NodeName }).Should(Equal(a.Name))
	eventually(t, func() string { return reason("first") }).Should(HavePrefix(impv1.ReasonVolumesNotReady + ": pod imp-vol-"))

	// The holder: pinned to node a through the scheduler, the claim at its place, restricted.
	first := e.get("first")
	pod := &corev1.Pod{}
	eventually(t, func() error {
		return e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: volumeholder.PodName(first.UID, first.Status.Instance)}, pod)
	}).Should(Succeed(), func() string { return reason("first") })
	terms := pod.Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms
	if pod.Spec.NodeName != "" || len(terms) != 1 || terms[0].MatchFields[0].Values[0] != a.Name {
		t.Errorf("the holder is not pinned to node a through the scheduler: %+v", pod.Spec)
	}
	if c := pod.Spec.Containers[0]; len(pod.Spec.Volumes) != 1 || pod.Spec.Volumes[0].PersistentVolumeClaim.ClaimName != "data" ||
		len(c.VolumeMounts) != 1 || c.VolumeMounts[0].MountPath != impv1.HolderMountDir+"/data" || !metav1.IsControlledBy(pod, first) {
		t.Errorf("the holder's volumes: %+v %+v", pod.Spec.Volumes, c.VolumeMounts)
	}
	// Its node runs it: the VM may start.
	pod.Spec.NodeName = a.Name
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, ContainerStatuses: []corev1.ContainerStatus{{Name: "hold", ContainerID: "containerd://0123456789abcdef",
		State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.Now()}}}}}
	if err := e.c.Status().Update(ctx, pod); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() bool {
		h := e.get("first").Status.VolumeHolder
		return h != nil && h.Ready && h.PodUID == string(pod.UID)
	}).Should(BeTrue())
	eventually(t, func() string { return reason("first") }).Should(HavePrefix(string(impv1.VMRunning)))
	if h := e.get("first").Status.VolumeHolder; len(h.Claims) != 1 || h.Claims[0].Block || h.Claims[0].SizeBytes != 1<<30 {
		t.Errorf("the held claims: %+v", h.Claims)
	}
	// A node drain cannot evict the holder from under the running VM (the kubelet would detach
	// the claim under its VMM): the VM's disruption budget lets no eviction of it pass.
	pdb := &policyv1.PodDisruptionBudget{}
	eventually(t, func() error {
		return e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: volumeholder.BudgetName(first.UID)}, pdb)
	}).Should(Succeed())
	if sel, err := metav1.LabelSelectorAsSelector(pdb.Spec.Selector); err != nil || !sel.Matches(labels.Set(pod.Labels)) ||
		pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() != 0 || !metav1.IsControlledBy(pdb, first) {
		t.Errorf("the holder's disruption budget: %+v", pdb)
	}
	// Asked once: client-go would retry a refused eviction ten times, after the server's
	// Retry-After each (100 s of the suite).
	err := kubernetes.NewForConfigOrDie(e.cl.Config).PolicyV1().RESTClient().Post().AbsPath("/api/v1").
		Namespace(e.ns).Resource("pods").Name(pod.Name).SubResource("eviction").MaxRetries(0).
		Body(&policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: pod.Name}}).Do(ctx).Error()
	if !apierrors.IsTooManyRequests(err) {
		t.Errorf("evicting the running VM's holder pod: %v, want it refused by the disruption budget", err)
	}
	if err := e.c.Get(ctx, client.ObjectKeyFromObject(pod), &corev1.Pod{}); err != nil {
		t.Errorf("the holder pod after an eviction: %v", err)
	}

	// The claim is ReadWriteOnce: a second VM waits for it; a missing claim is named.
	e.create(withClaim("second", "data"), withClaim("third", "missing"))
	eventually(t, func() string { return reason("second") }).Should(And(HavePrefix(impv1.ReasonVolumeInUse+": "), ContainSubstring("attached to VM first")))
	eventually(t, func() string { return reason("third") }).Should(Equal(impv1.ReasonVolumeClaimNotFound + `: PersistentVolumeClaim "missing" does not exist in namespace ` + e.ns))
	// Another namespace's VM cannot name the claim.
	other := e.cl.Namespace(t)
	thief := withClaim("thief", "data")
	thief.Namespace = other
	e.create(thief)
	eventually(t, func() string {
		v := &impv1.ImpVM{}
		_ = e.c.Get(ctx, client.ObjectKeyFromObject(thief), v)
		if c := condition(v, impv1.ScheduledCondition); c != nil {
			return c.Reason + ": " + c.Message
		}
		return ""
	}).Should(Equal(impv1.ReasonVolumeClaimNotFound + `: PersistentVolumeClaim "data" does not exist in namespace ` + other))

	// The first gone: the second is placed, with a holder of its own.
	if err := e.c.Delete(ctx, e.get("first")); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() string { return e.get("second").Status.NodeName }).Should(Equal(a.Name))
	second := e.get("second")
	holderKey := client.ObjectKey{Namespace: e.ns, Name: volumeholder.PodName(second.UID, second.Status.Instance)}
	eventually(t, func() error { return e.c.Get(ctx, holderKey, &corev1.Pod{}) }).Should(Succeed())

	// A pod of the holder's name that IMP did not make (here: with a volume more) is never the
	// holder: removed and made again.
	stop()
	genuine := &corev1.Pod{}
	if err := e.c.Get(ctx, holderKey, genuine); err != nil {
		t.Fatal(err)
	}
	if err := e.c.Delete(ctx, genuine, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() bool { return e.c.Get(ctx, holderKey, &corev1.Pod{}) != nil }).Should(BeTrue())
	impostor := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: holderKey.Name, Labels: genuine.Labels,
		OwnerReferences: genuine.OwnerReferences}, Spec: *genuine.Spec.DeepCopy()}
	impostor.Spec.NodeName = ""
	impostor.Spec.Volumes = append(impostor.Spec.Volumes, corev1.Volume{Name: "extra", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}})
	impostor.Spec.Containers[0].VolumeMounts = append(impostor.Spec.Containers[0].VolumeMounts, corev1.VolumeMount{Name: "extra", MountPath: "/extra"})
	// The chart's policy (which an earlier test of the package may have installed) would refuse
	// it: the operator's own check is what this part tests.
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: "imp-volume-holders"}}
	if err := e.c.Delete(ctx, binding); client.IgnoreNotFound(err) != nil {
		t.Fatal(err)
	}
	eventually(t, func() error { return e.c.Create(ctx, impostor) }).Should(Succeed())
	e.startOperator()
	eventually(t, func() string {
		p := &corev1.Pod{}
		if err := e.c.Get(ctx, holderKey, p); err != nil {
			return err.Error()
		}
		if p.UID == impostor.UID {
			return "the impostor"
		}
		return fmt.Sprintf("%d volumes", len(p.Spec.Volumes))
	}).Should(Equal("1 volumes"))
	if h := e.get("second").Status.VolumeHolder; h != nil && h.PodUID == string(impostor.UID) {
		t.Errorf("the impostor was reported as the holder: %+v", h)
	}

	// With the chart's policy, nobody but the operator makes a pod of a holder's name or
	// label; the operator's holders pass it.
	e.cl.InstallChartObjects(t, "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
	squatter := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "imp-vol-squatter"}, Spec: *genuine.Spec.DeepCopy()}
	squatter.Spec.NodeName = ""
	eventually(t, func() string {
		err := e.c.Create(ctx, squatter.DeepCopy(), client.DryRunAll)
		if err == nil {
			return "admitted"
		}
		return err.Error()
	}).Should(ContainSubstring("only the operator makes or changes those"))
	e.create(withClaim("fourth", "data2"))
	eventually(t, func() error {
		v := e.get("fourth")
		if v.Status.VolumeHolder == nil {
			return fmt.Errorf("no holder yet: %s", reason("fourth"))
		}
		return e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: volumeholder.PodName(v.UID, v.Status.Instance)}, &corev1.Pod{})
	}).Should(Succeed())

	holderShape(t, e, client.ObjectKey{Namespace: e.ns, Name: volumeholder.PodName(e.get("fourth").UID, e.get("fourth").Status.Instance)})

	// Its tenant, whose role may delete the namespace's pods, cannot delete the holder from
	// under the VM (the kubelet would detach the claim); deleting the VM removes it, by the
	// operator, through the same policy.
	fourth := e.get("fourth")
	fourthHolder := client.ObjectKey{Namespace: e.ns, Name: volumeholder.PodName(fourth.UID, fourth.Status.Instance)}
	e.create(&rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "pod-admin"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "delete"}},
			{APIGroups: []string{"policy"}, Resources: []string{"poddisruptionbudgets"}, Verbs: []string{"get", "list", "create", "update", "patch", "delete"}}}})
	tenant := e.tenant("Role", "pod-admin")
	holderPod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: fourthHolder.Name}}
	eventually(t, func() error { return tenant.Delete(ctx, holderPod, client.DryRunAll) }).
		Should(MatchError(ContainSubstring("holds the volumes of ImpVM fourth")))
	if err := tenant.Delete(ctx, holderPod, client.GracePeriodSeconds(0)); !apierrors.IsForbidden(err) {
		t.Errorf("the tenant deleting its running VM's holder pod: %v, want it forbidden", err)
	}
	if err := e.c.Get(ctx, fourthHolder, &corev1.Pod{}); err != nil {
		t.Errorf("the holder pod after the tenant's delete: %v", err)
	}
	// Another pod of the namespace is the tenant's to delete.
	plain := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "plain"}, Spec: *genuine.Spec.DeepCopy()}
	plain.Spec.NodeName, plain.Spec.Volumes, plain.Spec.Containers[0].VolumeMounts = "", nil, nil
	e.create(plain)
	if err := tenant.Delete(ctx, plain, client.GracePeriodSeconds(0)); err != nil {
		t.Errorf("the tenant deleting a pod of its own: %v", err)
	}
	// Nor can the tenant loosen or remove the budget that refuses the holder's evictions (then
	// evict it), or make one of its name; changed or removed anyway (system:masters), the
	// operator puts it back.
	budgetKey := client.ObjectKey{Namespace: e.ns, Name: volumeholder.BudgetName(fourth.UID)}
	loosen := func(cl client.Client) error {
		pdb := &policyv1.PodDisruptionBudget{}
		if err := e.c.Get(ctx, budgetKey, pdb); err != nil {
			return err
		}
		pdb.Spec.MaxUnavailable = ptr.To(intstr.FromInt32(1))
		return cl.Update(ctx, pdb)
	}
	eventually(t, func() error { return loosen(tenant) }).Should(MatchError(ContainSubstring("only IMP makes, changes or removes it")))
	if err := tenant.Delete(ctx, &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: budgetKey.Name}}); !apierrors.IsForbidden(err) {
		t.Errorf("the tenant deleting its VM's disruption budget: %v, want it forbidden", err)
	}
	squat := &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "imp-vol-squat"},
		Spec: policyv1.PodDisruptionBudgetSpec{MaxUnavailable: ptr.To(intstr.FromString("100%"))}}
	if err := tenant.Create(ctx, squat, client.DryRunAll); !apierrors.IsForbidden(err) {
		t.Errorf("the tenant making a budget named imp-vol-*: %v, want it forbidden", err)
	}
	maxUnavailable := func() string {
		pdb := &policyv1.PodDisruptionBudget{}
		if err := e.c.Get(ctx, budgetKey, pdb); err != nil {
			return err.Error()
		}
		return pdb.Spec.MaxUnavailable.String()
	}
	if err := loosen(e.c); err != nil {
		t.Fatal(err)
	}
	eventually(t, maxUnavailable).Should(Equal("0"), "the loosened budget put back")
	if err := e.c.Delete(ctx, &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: budgetKey.Name}}); err != nil {
		t.Fatal(err)
	}
	eventually(t, maxUnavailable).Should(Equal("0"), "the removed budget made again")

	if err := e.c.Delete(ctx, fourth); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() bool {
		p := &corev1.Pod{}
		return apierrors.IsNotFound(e.c.Get(ctx, fourthHolder, p)) || !p.DeletionTimestamp.IsZero()
	}).Should(BeTrue(), "the deleted VM's holder removed by the operator")
}

// holderShape: the operator's identity (a stolen token) makes a pod of the holder's shape but for
// one field, a pod that would hold a node's port, run another program, add a capability, run
// unconfined, as another ServiceAccount or with its token, or with the host's /proc: the chart's
// policy refuses each, naming the rule; the holder as the operator makes it passes.
func holderShape(t *testing.T, e *env, genuine client.ObjectKey) {
	t.Helper()
	ctx := context.Background()
	operator, err := client.New(e.cl.As(t, testcluster.Operator), client.Options{Scheme: e.cl.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	holder := &corev1.Pod{}
	if err := e.c.Get(ctx, genuine, holder); err != nil {
		t.Fatal(err)
	}
	// In a namespace without Pod Security (kube-system's), where the policy alone stands.
	ns := e.cl.Namespace(t)
	runtime := &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: ns + "-privileged"}, Handler: "privileged"}
	e.create(runtime)
	t.Cleanup(func() { _ = e.c.Delete(context.Background(), runtime) })
	shaped := func(change func(*corev1.Pod)) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "imp-vol-shaped", Labels: holder.Labels},
			Spec: *holder.Spec.DeepCopy()}
		p.Spec.NodeName = ""
		change(p)
		return p
	}
	sc := func(p *corev1.Pod) *corev1.SecurityContext { return p.Spec.Containers[0].SecurityContext }
	unconfined := corev1.SeccompProfile{Type: corev1.SeccompProfileTypeUnconfined}
	for _, c := range []struct {
		name, rule string
		change     func(*corev1.Pod)
	}{
		{"a host port", "no ports (no hostPort)", func(p *corev1.Pod) {
			p.Spec.Containers[0].Ports = []corev1.ContainerPort{{ContainerPort: 10250, HostPort: 10250}}
		}},
		{"a command", "no other command", func(p *corev1.Pod) { p.Spec.Containers[0].Command = []string{"/bin/sh"} }},
		{"other arguments", "no other command", func(p *corev1.Pod) { p.Spec.Containers[0].Args = []string{"--kubeconfig=/x"} }},
		{"a lifecycle hook", "lifecycle hooks", func(p *corev1.Pod) {
			p.Spec.Containers[0].Lifecycle = &corev1.Lifecycle{PostStart: &corev1.LifecycleHandler{Exec: &corev1.ExecAction{Command: []string{"/imp-operator"}}}}
		}},
		{"an environment", "environment", func(p *corev1.Pod) {
			p.Spec.Containers[0].Env = []corev1.EnvVar{{Name: "KUBERNETES_SERVICE_HOST", Value: "10.0.0.1"}}
		}},
		{"an added capability", "adds none", func(p *corev1.Pod) { sc(p).Capabilities.Add = []corev1.Capability{"NET_ADMIN"} }},
		{"capabilities kept", "drops every capability", func(p *corev1.Pod) { sc(p).Capabilities.Drop = nil }},
		{"an unconfined pod seccomp profile", "default seccomp profile", func(p *corev1.Pod) { p.Spec.SecurityContext.SeccompProfile = &unconfined }},
		{"an unconfined container seccomp profile", "default seccomp profile", func(p *corev1.Pod) { sc(p).SeccompProfile = &unconfined }},
		{"an unconfined AppArmor profile", "AppArmor", func(p *corev1.Pod) {
			p.Spec.SecurityContext.AppArmorProfile = &corev1.AppArmorProfile{Type: corev1.AppArmorProfileTypeUnconfined}
		}},
		{"an unconfined container AppArmor profile", "AppArmor", func(p *corev1.Pod) {
			sc(p).AppArmorProfile = &corev1.AppArmorProfile{Type: corev1.AppArmorProfileTypeUnconfined}
		}},
		{"an AppArmor annotation", "AppArmor", func(p *corev1.Pod) {
			p.Annotations = map[string]string{"container.apparmor.security.beta.kubernetes.io/hold": "unconfined"}
		}},
		{"the host's /proc", "default /proc mount", func(p *corev1.Pod) {
			sc(p).ProcMount, p.Spec.HostUsers = ptr.To(corev1.UnmaskedProcMount), ptr.To(false)
		}},
		{"another user", "runs as 65534", func(p *corev1.Pod) { sc(p).RunAsUser = ptr.To[int64](0) }},
		{"a sysctl", "sysctls", func(p *corev1.Pod) {
			p.Spec.SecurityContext.Sysctls = []corev1.Sysctl{{Name: "net.ipv4.ip_unprivileged_port_start", Value: "0"}}
		}},
		{"another ServiceAccount", "default ServiceAccount", func(p *corev1.Pod) { p.Spec.ServiceAccountName = "imp-operator" }},
		{"its token", "without its token", func(p *corev1.Pod) { p.Spec.AutomountServiceAccountToken = ptr.To(true) }},
		{"no word on its token", "without its token", func(p *corev1.Pod) { p.Spec.AutomountServiceAccountToken = nil }},
		{"another runtime", "default runtime", func(p *corev1.Pod) { p.Spec.RuntimeClassName = &runtime.Name }},
		{"a system priority", "below the system priority classes", func(p *corev1.Pod) {
			p.Spec.PriorityClassName, p.Spec.Priority = "system-node-critical", nil
		}},
		{"a large request", "requests at most", func(p *corev1.Pod) {
			p.Spec.Containers[0].Resources.Requests[corev1.ResourceMemory] = resource.MustParse("64Gi")
			p.Spec.Containers[0].Resources.Limits[corev1.ResourceMemory] = resource.MustParse("64Gi")
		}},
		{"a device's request", "requests at most", func(p *corev1.Pod) {
			p.Spec.Containers[0].Resources.Requests["nvidia.com/gpu"] = resource.MustParse("1")
			p.Spec.Containers[0].Resources.Limits["nvidia.com/gpu"] = resource.MustParse("1")
		}},
		{"a node of its choosing", "placed by the scheduler", func(p *corev1.Pod) { p.Spec.NodeName = "any" }},
	} {
		err := operator.Create(ctx, shaped(c.change), client.DryRunAll)
		if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), c.rule) {
			t.Errorf("the operator making a holder with %s: %v, want it refused naming %q", c.name, err, c.rule)
		}
	}
	if err := operator.Create(ctx, shaped(func(*corev1.Pod) {}), client.DryRunAll); err != nil {
		t.Errorf("the operator making a holder as it makes them: %v", err)
	}
}
