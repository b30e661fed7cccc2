package e2e

import (
	"crypto/tls"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/testcluster"
	"github.com/syscode-labs/imp/internal/testguest"
)

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return fmt.Sprint(l.Addr().(*net.TCPAddr).Port)
}

// TestDay0Runbook walks ../shared/spec/day0-runbook.md (docs/day0.md) against the chart on a
// control plane with controller-manager and scheduler, and two kinds of nodes: this machine,
// joined as the real node imp-host (kubelet, containerd and runc: hack/real-node.sh), where the
// chart's pods run from the images `make images` pushed to an OCI registry on 127.0.0.1, and
// kwok nodes standing for the rest of the fleet (two labelled imp/enabled=true, one not). Each
// command of the runbook runs as written and its output is checked. On the real node the
// preflight runs, the operator and the agent run with the chart's identities and nothing more,
// the runbook's sample ImpVM boots under QEMU, and it keeps running, untouched, through every
// way its agent's pod goes away: the OnDelete roll, a drain, an OOM kill, a crash loop, a
// rollback and an uninstall.
func TestDay0Runbook(t *testing.T) {
	if testing.Short() {
		t.Skip("walks the Day-0 runbook on a full control plane and a real node")
	}
	if os.Geteuid() != 0 {
		t.Skip("this machine joins as a real node: needs root")
	}
	bin, err := testcluster.AssetsDir()
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{"kube-controller-manager", "kube-scheduler", "kwok", "helm", "registry", "kubelet"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			t.Fatalf("%s not found in %s (hack/setup-control-plane.sh builds it)", b, bin)
		}
	}
	root, err := testcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	state := filepath.Join(tmp, "cp")
	regPort, apiPort := freePort(t), freePort(t)
	registry := "127.0.0.1:" + regPort
	// The API server reaches the kubelet (logs, exec) as the admin, and listens where pods reach
	// it too (hack/real-node.sh sends the kubernetes Service there).
	pki := filepath.Join(state, "pki")
	env := append(os.Environ(), "CP_BIN_DIR="+bin, "WITH_REGISTRY=1", "REGISTRY_PORT="+regPort,
		"ETCD_PORT="+freePort(t), "ETCD_PEER_PORT="+freePort(t), "APISERVER_PORT="+apiPort, "KCM_PORT="+freePort(t),
		"SCHEDULER_PORT="+freePort(t), "KWOK_PORT="+freePort(t), "KUBELET_PORT="+freePort(t), "KUBELET_HEALTHZ_PORT="+freePort(t),
		"NODE_NAME="+realNode, "REGISTRY="+registry,
		"APISERVER_EXTRA_ARGS=--kubelet-client-certificate "+pki+"/admin.crt --kubelet-client-key "+pki+"/admin.key"+
			" --kubelet-preferred-address-types InternalIP --bind-address 0.0.0.0")
	start := exec.Command(filepath.Join(root, "hack/start-control-plane.sh"), state)
	start.Env = env
	if out, err := start.CombinedOutput(); err != nil {
		t.Fatalf("starting the control plane: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		if err := resetHost(); err != nil {
			t.Errorf("cleaning up the real node: %v", err)
		}
		stop := exec.Command(filepath.Join(root, "hack/stop-control-plane.sh"), state, "--purge")
		stop.Env = env
		_ = stop.Run()
	})
	t0 := time.Now()
	up := exec.Command(filepath.Join(root, "hack/real-node.sh"), "up", nodeState, state)
	up.Env = env
	if out, err := up.CombinedOutput(); err != nil {
		t.Fatalf("joining this machine as node %s: %v\n%s", realNode, err, out)
	}
	t.Logf("real node %s Ready %.1fs after joining", realNode, time.Since(t0).Seconds())
	kubeconfig := filepath.Join(state, "kubeconfig")
	plugins := filepath.Join(tmp, "bin")
	build := exec.Command("go", "build", "-o", plugins+"/", "./cmd/kubectl-imp")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building kubectl-imp: %v\n%s", err, out)
	}
	env = append(env, "KUBECONFIG="+kubeconfig, "PATH="+plugins+":"+bin+":"+os.Getenv("PATH"), "HELM_CACHE_HOME="+filepath.Join(tmp, "helm-cache"),
		"HELM_CONFIG_HOME="+filepath.Join(tmp, "helm-config"), "HELM_DATA_HOME="+filepath.Join(tmp, "helm-data"))

	// sh runs a runbook line through the shell as an operator types it.
	sh := func(line string) (string, error) {
		t.Helper()
		cmd := exec.Command("bash", "-o", "pipefail", "-c", line)
		cmd.Env, cmd.Dir = env, tmp
		out, err := cmd.CombinedOutput()
		t.Logf("$ %s\n%s", line, out)
		return string(out), err
	}
	must := func(line string, wants ...string) string {
		t.Helper()
		out, err := sh(line)
		if err != nil {
			t.Fatalf("%s: %v", line, err)
		}
		for _, w := range wants {
			if !strings.Contains(out, w) {
				t.Errorf("%s: output lacks %q", line, w)
			}
		}
		return out
	}
	eventually := func(what string, timeout time.Duration, f func() error) {
		t.Helper()
		deadline := time.Now().Add(timeout)
		for {
			err := f()
			if err == nil {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %v", what, err)
			}
			time.Sleep(500 * time.Millisecond)
		}
	}

	// Nodes: kwok-a and kwok-b for the pool, kwok-c outside it; this machine joined above.
	var nodes strings.Builder
	for _, n := range []string{"kwok-a", "kwok-b", "kwok-c"} {
		fmt.Fprintf(&nodes, `apiVersion: v1
kind: Node
metadata:
  name: %s
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
  labels: {kubernetes.io/hostname: %s, kubernetes.io/os: linux, kubernetes.io/arch: amd64, imp.test/node: %s}
---
`, n, n, n)
	}
	if err := os.WriteFile(filepath.Join(tmp, "nodes.yaml"), []byte(nodes.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl apply -f nodes.yaml")
	must("kubectl label node "+realNode+" imp.test/node="+realNode, "labeled")

	// Build and push the images and the chart, as a release pipeline would.
	images := must(filepath.Join(root, "hack/images.sh") + " " + registry)
	digest := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(images), "\n") {
		if name, ref, ok := strings.Cut(l, "="); ok && strings.Contains(ref, "@sha256:") {
			digest[name] = ref[strings.Index(ref, "@")+1:]
		}
	}
	if digest["imp-operator"] == "" || digest["imp-agent"] == "" {
		t.Fatalf("no image digests in:\n%s", images)
	}
	must(filepath.Join(root, "hack/chart-push.sh")+" "+registry, "Pushed: "+registry+"/charts/imp:0.9.0")
	chart := "oci://" + registry + "/charts/imp"

	// ## Privileged Namespace
	must("kubectl create namespace imp-system --dry-run=client -o yaml | kubectl apply -f -", "namespace/imp-system")
	must("kubectl label namespace imp-system pod-security.kubernetes.io/enforce=privileged --overwrite", "namespace/imp-system labeled")

	// ## Node Selector imp/enabled=true
	for _, n := range []string{"kwok-a", "kwok-b", realNode} {
		must("kubectl label node "+n+" imp/enabled=true --overwrite", "node/"+n+" labeled")
	}
	out := must("kubectl get nodes -l imp/enabled=true", "kwok-a", "kwok-b", realNode)
	if strings.Contains(out, "kwok-c") {
		t.Errorf("kwok-c is listed as an IMP node")
	}

	// ## Install (OCI), with the production values of ## Image Digest Pin, the images from the
	// test's registry and the selectors written out so that helm get values shows them. A second
	// file holds what this machine differs in from a production node: no KVM, the guest kernel
	// and the agent's host directories under the node's state, no room to reserve, and the
	// operator on the one node that runs containers.
	values := fmt.Sprintf(`# values-production.yaml
operator:
  image:
    repository: %[1]s/imp-operator
    digest: %[2]s
agent:
  image:
    repository: %[1]s/imp-agent
    digest: %[3]s
  nodeSelector:
    imp/enabled: "true"
kvm:
  preflight:
    nodeSelector:
      imp/enabled: "true"
`, registry, digest["imp-operator"], digest["imp-agent"])
	if err := os.WriteFile(filepath.Join(tmp, "values-production.yaml"), []byte(values), 0o644); err != nil {
		t.Fatal(err)
	}
	// The kernel as a node would hold it: readable by the VMMs' unprivileged users.
	kernel := filepath.Join(nodeState, "boot/vmlinuz")
	if err := os.MkdirAll(filepath.Dir(kernel), 0o755); err != nil {
		t.Fatal(err)
	}
	if data, err := os.ReadFile(testguest.Kernel(t)); err != nil || os.WriteFile(kernel, data, 0o644) != nil {
		t.Fatalf("copying the guest kernel: %v", err)
	}
	// IMP_E2E_VMM=firecracker runs the VM under Firecracker, on a node with KVM and firecracker
	// and jailer at the chart's default paths (docs/day0.md); without it, QEMU under TCG.
	vmmKind, noKVM := os.Getenv("IMP_E2E_VMM"), "\n  qemuAccel: tcg"
	if vmmKind == "firecracker" {
		noKVM = ""
	}
	otel := startCollector(t, bin, tmp)
	machine := fmt.Sprintf(`# values-this-machine.yaml
operator:
  nodeSelector:
    imp.test/node: %[1]s
  # This machine is the cluster's one node, and it runs VMs: the operator may run beside them
  # (by default it never does: root on a VM node would get its token).
  runOnVMNodes: true
agent:
  stateDir: %[2]s%[6]s
  reserve: {vcpus: 0, memory: "0", disk: 1Gi}
  vcpuOvercommit: 4
  insecureRegistries: [%[3]q]
kvm:
  preflight:
    requireKVM: %[7]t
guest:
  kernel:
    hostPath: %[4]s
network:
  nsDir: %[5]s
  # The domain egress proxy asks the DNS server of the test's internet (checkDomainEgress).
  egressNameserver: %[8]q
# Every start traced, to a real OpenTelemetry Collector on the node (checkStartTrace).
observability:
  tracing: {enabled: true, endpoint: %[9]q, protocol: grpc, insecure: true, sampleRatio: 1}
`, realNode, agentState, registry, kernel, filepath.Join(nodeState, "run/imp/netns"), noKVM, noKVM == "", inetNameserver, otel.Endpoint)
	if err := os.WriteFile(filepath.Join(tmp, "values-this-machine.yaml"), []byte(machine), 0o644); err != nil {
		t.Fatal(err)
	}
	helmInstall := "helm upgrade --install imp " + chart + " --version 0.9.0 -n imp-system --create-namespace --plain-http"
	valueFiles := " -f values-production.yaml -f values-this-machine.yaml"
	must(helmInstall+valueFiles, "STATUS: deployed", "REVISION: 1")
	// The preflight ran on each labelled node, for real on this one, and its checks are kept.
	must("kubectl -n imp-system get pods -l app.kubernetes.io/name=imp-preflight,imp.dev/node="+realNode+" -o jsonpath='{.items[*].status.phase}'", "Succeeded")
	must("kubectl -n imp-system logs -l app.kubernetes.io/name=imp-preflight,imp.dev/node="+realNode, "kvm", "preflight passed")
	must("kubectl -n imp-system get jobs -l app.kubernetes.io/name=imp-preflight", "imp-preflight-")

	type podState struct{ name, uid, image, imageID, phase, ready, restarts, lastReason string }
	runtimePods := func() (map[string]podState, error) {
		out, err := sh(`kubectl -n imp-system get pods -l app.kubernetes.io/name=imp-runtime -o jsonpath='{range .items[*]}{.spec.nodeName} {.metadata.name} {.metadata.uid} {.spec.containers[0].image} {.status.containerStatuses[0].imageID}x {.status.phase} {.status.conditions[?(@.type=="Ready")].status}x {.status.containerStatuses[0].restartCount}x {.status.containerStatuses[0].lastState.terminated.reason}x{"\n"}{end}'`)
		if err != nil {
			return nil, err
		}
		got := map[string]podState{}
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			if f := strings.Fields(l); len(f) == 9 {
				if _, dup := got[f[0]]; dup {
					return nil, fmt.Errorf("two imp-runtime pods on %s", f[0])
				}
				got[f[0]] = podState{f[1], f[2], f[3], strings.TrimSuffix(f[4], "x"), f[5], strings.TrimSuffix(f[6], "x"),
					strings.TrimSuffix(f[7], "x"), strings.TrimSuffix(f[8], "x")}
			}
		}
		return got, nil
	}
	agentImage := registry + "/imp-agent@" + digest["imp-agent"]
	// agentReady waits for this node's agent to run image and be Ready, other than the pod old.
	agentReady := func(image, old string) podState {
		t.Helper()
		var p podState
		eventually("imp-runtime on "+realNode+" running "+image+" and Ready", 3*time.Minute, func() error {
			got, err := runtimePods()
			if err != nil {
				return err
			}
			if p = got[realNode]; p.uid == old || p.image != image || p.phase != "Running" || p.ready != "True" {
				return fmt.Errorf("%+v", p)
			}
			return nil
		})
		return p
	}
	agentPod := agentReady(agentImage, "")
	if !strings.HasSuffix(agentPod.imageID, digest["imp-agent"]) {
		t.Errorf("the agent runs image %s, want digest %s", agentPod.imageID, digest["imp-agent"])
	}
	eventually("imp-runtime on exactly the labelled nodes", 3*time.Minute, func() error {
		got, err := runtimePods()
		if err != nil {
			return err
		}
		for _, n := range []string{"kwok-a", "kwok-b"} {
			if got[n].image != agentImage || got[n].phase != "Running" {
				return fmt.Errorf("node %s: %+v", n, got[n])
			}
		}
		if len(got) != 3 {
			return fmt.Errorf("imp-runtime pods on %v, want kwok-a, kwok-b and %s only", got, realNode)
		}
		return nil
	})
	// The operator's two replicas run on the real node, from their image by digest, as the
	// chart's ServiceAccount, and one of them leads.
	operatorPods := func() error {
		out, err := sh(`kubectl -n imp-system get pods -l app.kubernetes.io/name=imp-operator -o jsonpath='{range .items[*]}{.spec.nodeName} {.spec.serviceAccountName} {.status.containerStatuses[0].imageID} {.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}'`)
		if err != nil {
			return err
		}
		want := fmt.Sprintf("%s imp-operator %s/imp-operator@%s True", realNode, registry, digest["imp-operator"])
		if l := strings.Split(strings.TrimSpace(out), "\n"); len(l) != 2 || l[0] != want || l[1] != want {
			return fmt.Errorf("operator pods %q, want twice %q", out, want)
		}
		// The API server proxies IMP's access (exec, console, logs) only once its availability
		// check has seen the operator's Service answer again: until then it says 503.
		out, err = sh(`kubectl get apiservice v1alpha1.subresources.imp.dev -o jsonpath='{.status.conditions[?(@.type=="Available")].status}'`)
		if err != nil || out != "True" {
			return fmt.Errorf("APIService v1alpha1.subresources.imp.dev Available %q %v", out, err)
		}
		return nil
	}
	eventually("operator pods Running and Ready", 3*time.Minute, operatorPods)
	must("kubectl -n imp-system get lease", "imp")
	must("helm get values imp -n imp-system | grep -A2 nodeSelector", "nodeSelector:", "imp/enabled: \"true\"")

	// ## Validation Steps
	must("kubectl get crd | grep imp", "impvms.imp.dev", "impvmclasses.imp.dev", "impnetworks.imp.dev", "impnodes.imp.dev", "impipaddresses.imp.dev")
	must("kubectl get nodes -l imp/enabled=true", "kwok-a", "kwok-b", realNode)
	must("kubectl -n imp-system get pods", "imp-operator-", "imp-runtime-")
	must("kubectl -n imp-system get ds imp-runtime -o yaml | grep -A2 updateStrategy", "updateStrategy:", "type: OnDelete")
	must("kubectl get impvm -A -o wide", "No resources found") // none yet: the API answers

	// The agent, in the host's network, serves its metrics to those the API server authorizes:
	// nobody without a token, not the operator, a reader bound to imp-metrics-reader.
	must("kubectl -n imp-system create serviceaccount prometheus", "serviceaccount/prometheus created")
	must("kubectl create clusterrolebinding imp-metrics-prometheus --clusterrole imp-metrics-reader --serviceaccount imp-system:prometheus", "created")
	scrape := func(token string) (int, string) {
		c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // the agent's certificate is self-signed
		req, _ := http.NewRequest("GET", "https://127.0.0.1:8090/metrics", nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := c.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	reader := strings.TrimSpace(must("kubectl -n imp-system create token prometheus --duration=10m"))
	if code, body := scrape(reader); code != http.StatusOK || !strings.Contains(body, "controller_runtime_reconcile_total") {
		t.Errorf("the metrics reader got %d: %.300s", code, body)
	}
	if code, _ := scrape(""); code != http.StatusUnauthorized {
		t.Errorf("a scrape without a token got %d, want 401", code)
	}
	if code, _ := scrape(strings.TrimSpace(must("kubectl -n imp-system create token imp-operator --duration=10m"))); code != http.StatusForbidden {
		t.Errorf("a scrape with a token not allowed /metrics got %d, want 403", code)
	}

	// ## Checklist step 5: the runbook's sample ImpVM, with its image from the test registry
	// (the hello workload ticks on its console and answers on TCP 7000), on the sample network.
	ref := testguest.Image(t, registry, "hello")
	var vm map[string]any
	for _, f := range []string{"imp_v1alpha1_impvm.yaml", "imp_v1alpha1_impnetwork.yaml"} {
		sample, err := os.ReadFile(filepath.Join(root, "config/samples", f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(tmp, f), sample, 0o644); err != nil {
			t.Fatal(err)
		}
		if f == "imp_v1alpha1_impvm.yaml" {
			if err := yaml.Unmarshal(sample, &vm); err != nil {
				t.Fatal(err)
			}
		}
	}
	spec := vm["spec"].(map[string]any)
	spec["image"], spec["command"], spec["args"] = ref.String(), []string{"/bin/hello"}, []string{"net"}
	spec["nodeSelector"] = map[string]any{"imp.test/node": realNode}
	spec["networkRef"] = map[string]any{"name": "default"}
	spec["stdin"], spec["tty"] = true, true // kubectl imp console types into the workload
	if vmmKind != "" {
		spec["vmm"] = vmmKind
	}
	data, _ := yaml.Marshal(vm)
	if err := os.WriteFile(filepath.Join(tmp, "hello.yaml"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl create namespace demo", "namespace/demo created")
	must("kubectl -n demo apply -f imp_v1alpha1_impnetwork.yaml", "impnetwork.imp.dev/default created")
	// At once: the chart's post-install hook waited until the API server admits ImpVMs
	// (its mutating policy fetches the new CRD's schema first; docs/operator.md).
	applying := time.Now()
	must("kubectl -n demo apply -f hello.yaml", "impvm.imp.dev/hello created")
	applied := time.Now()
	vmState := func() (string, error) {
		return sh("kubectl -n demo get impvm hello -o jsonpath='{.status.phase} {.status.conditions[?(@.type==\"Ready\")].status} {.status.nodeName} {.status.ip}'")
	}
	// Polled closely: create → Ready was at least from the apply's end to the start of the
	// last poll that saw it not Ready, at most from the apply's start to the end of the first
	// that saw it Ready (checkStartTrace).
	var ip string
	var notReadyPoll time.Time
	for deadline := time.Now().Add(5 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
		polled := time.Now()
		out, err := vmState()
		if f := strings.Fields(out); err == nil && len(f) == 4 && f[0]+" "+f[1]+" "+f[2] == "Running True "+realNode {
			seenMax := time.Since(applying)
			ip = f[3]
			checkStartTrace(t, otel, must("kubectl -n demo get impvm hello -o jsonpath='{.metadata.annotations.imp\\.dev/trace-context}'"),
				notReadyPoll.Sub(applied), seenMax)
			break
		}
		notReadyPoll = polled
		if time.Now().After(deadline) {
			t.Fatalf("the sample VM Running and Ready: %q %v", out, err)
		}
	}
	if !strings.HasPrefix(ip, "10.100.0.") {
		t.Errorf("the VM's address %s is not from ImpNetwork default (10.100.0.0/24)", ip)
	}
	must("kubectl get impvm -A -o wide", "hello", "Running", realNode, "/hello@sha256:", "booted")
	// Through the API server's aggregation layer to the operator, then the node's agent, which
	// serves once it has read the certificate the operator issued (every 5 s until then).
	eventually("kubectl imp logs", 3*time.Minute, func() error {
		if out, err := sh("kubectl imp logs -n demo hello"); err != nil || !strings.Contains(out, "hello: tick") {
			return fmt.Errorf("%v: %.300s", err, out)
		}
		return nil
	})
	// Its figures the same way: the node's, and its guest's own (every 5 s after ready).
	eventually("kubectl imp top", 2*time.Minute, func() error {
		out, err := sh("kubectl imp top -n demo")
		if f := strings.Fields(lastLine(out)); err != nil || len(f) != 9 || f[0] != "hello" || !strings.HasSuffix(f[4], "%") {
			return fmt.Errorf("%v: %.300s", err, out)
		}
		t.Logf("kubectl imp top -n demo:\n%s", out)
		return nil
	})

	// The VM as the host sees it: its VMM's pid and start time, its console, its address.
	recs, _ := filepath.Glob(filepath.Join(agentState, "vms", "*", vmm.RecordFile))
	if len(recs) != 1 {
		t.Fatalf("VM records %v, want one", recs)
	}
	first, err := vmm.ReadRecord(filepath.Dir(recs[0]))
	if err != nil || !first.Alive() {
		t.Fatalf("the VM's record: %+v %v", first, err)
	}
	// The console log: in the VM's directory under QEMU, in its jail under Firecracker.
	var console string
	_ = filepath.WalkDir(agentState, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Name() == "console.log" && console == "" {
			console = p
		}
		return nil
	})
	lastTick := func() int {
		data, _ := os.ReadFile(console)
		n := -1
		for _, l := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(l), "hello: tick "); ok {
				fmt.Sscan(v, &n)
			}
		}
		return n
	}
	netns, _ := filepath.Glob(filepath.Join(nodeState, "run/imp/netns/impn*"))
	if len(netns) != 1 {
		t.Fatalf("network namespaces %v, want one", netns)
	}
	// untouched checks the VM is the same process, still running, its console still ticking and
	// its address answering from its network.
	untouched := func(after string) {
		t.Helper()
		rec, err := vmm.ReadRecord(filepath.Dir(recs[0]))
		if err != nil || rec.Pid != first.Pid || rec.StartTime != first.StartTime || !rec.Alive() {
			t.Fatalf("after %s the VM's VMM is %+v (%v), was %+v", after, rec, err, first)
		}
		tick := lastTick()
		eventually("the console ticking after "+after, 30*time.Second, func() error {
			if n := lastTick(); n <= tick {
				return fmt.Errorf("last tick %d", n)
			}
			return nil
		})
		eventually("the VM answering after "+after, 30*time.Second, func() error {
			out, err := exec.Command("nsenter", "--net="+netns[0], "bash", "-c", "exec 3<>/dev/tcp/"+ip+"/7000 && timeout 5 cat <&3").CombinedOutput()
			if err != nil || !strings.Contains(string(out), "hello from") {
				return fmt.Errorf("%v: %s", err, out)
			}
			return nil
		})
		t.Logf("after %s: VMM pid %d, same start time, console at tick %d, %s answers", after, rec.Pid, lastTick(), ip)
	}
	vmReady := func(after string) {
		t.Helper()
		eventually("the VM Running and Ready after "+after, time.Minute, func() error {
			if out, err := vmState(); err != nil || out != "Running True "+realNode+" "+ip {
				return fmt.Errorf("%q %v", out, err)
			}
			return nil
		})
	}
	untouched("booting")

	// ## Access through the API (docs/access.md): kubectl imp exec, exec -it, console, logs -f
	// and port-forward, as a user runs them, through the API server to the node's agent.
	checkKubectlImp(t, env, tmp, ref.String(), realNode, vmmKind)

	// ## Snapshots (docs/snapshots.md): kubectl imp snapshot, and a VM started from it.
	if vmmKind == "" || vmmKind == "qemu" {
		checkSnapshots(t, sh, must, eventually, tmp, realNode, vm)
		checkTemplates(t, sh, must, eventually, tmp, vm)
		// ## Warm pools (docs/warmpools.md): claims handed running members, real guests.
		checkWarmPools(t, sh, must, eventually, tmp, vm)
	}

	// ## Services reach VMs (docs/networking.md): kube-proxy and CoreDNS of the real node.
	client := checkServices(t, sh, must, eventually, tmp, root, registry, ref.String(), realNode)

	// ## NetworkPolicy (docs/networking.md): the reachability matrix, pods and VMs.
	checkNetworkPolicy(t, sh, must, eventually, env, tmp, client, ref.String(), realNode)
	// ## Domain egress (docs/networking.md): allowed names only, through the node's proxy.
	checkDomainEgress(t, sh, must, eventually, tmp, ref.String(), realNode)

	// ## Pools (docs/pools.md): scaled, rolled and undone behind a Service, real guests.
	if vmmKind == "" || vmmKind == "qemu" {
		checkPools(t, sh, must, eventually, tmp, realNode, ref.String(), testguest.Image(t, registry, "hello2").String())
	}

	// ## A whole OS (docs/os.md): systemd, an SSH key from a Secret, ssh through a Service.
	if vmmKind == "" || vmmKind == "qemu" {
		checkOS(t, sh, must, eventually, env, tmp, root, registry, realNode)
	}

	// ## Runtime OnDelete: an upgrade that changes the agent image replaces no imp-runtime pod.
	must(helmInstall+valueFiles+" --set agent.image.digest= --set agent.image.tag=0.9.0", "STATUS: deployed", "REVISION: 2")
	newImage := registry + "/imp-agent:0.9.0"
	must("kubectl -n imp-system get ds imp-runtime -o jsonpath='{.spec.template.spec.containers[0].image}'", newImage)
	time.Sleep(3 * time.Second)
	if got, _ := runtimePods(); got[realNode].uid != agentPod.uid || got["kwok-b"].image != agentImage {
		t.Errorf("imp-runtime pods changed on upgrade: %+v, then %+v", agentPod, got)
	}
	// The roll procedure, on the real node: the drain evicts the operator's pods and leaves the
	// agent's; deleting the agent's pod is the roll. The VM runs on throughout, and the new agent
	// adopts it.
	must("kubectl cordon "+realNode, "cordoned")
	must("kubectl drain "+realNode+" --ignore-daemonsets --delete-emptydir-data --timeout=2m", "drained")
	untouched("the drain")
	must("kubectl -n imp-system delete pod -l app.kubernetes.io/name=imp-runtime --field-selector spec.nodeName="+realNode, "deleted")
	must("kubectl uncordon "+realNode, "uncordoned")
	agentPod = agentReady(newImage, agentPod.uid)
	if got, _ := runtimePods(); got["kwok-b"].image != agentImage {
		t.Errorf("kwok-b rolled too: %+v", got["kwok-b"])
	}
	untouched("the OnDelete roll")
	vmReady("the OnDelete roll")
	eventually("operator pods back after the drain", 3*time.Minute, operatorPods)
	// The restarted agent serves with the certificate it kept (its state directory), without
	// waiting for the operator it was drained with.
	must("kubectl imp logs -n demo hello", "hello: tick")

	// The agent OOM-killed: a memory limit it cannot start in. The kernel kills it again and
	// again (a crash loop); its VM, in cgroups of its own, is not touched.
	must(helmInstall+valueFiles+" --set agent.resources.limits.memory=12Mi --set agent.resources.requests.memory=12Mi", "STATUS: deployed", "REVISION: 3")
	must("kubectl -n imp-system delete pod -l app.kubernetes.io/name=imp-runtime --field-selector spec.nodeName="+realNode, "deleted")
	eventually("the agent OOM-killed", 2*time.Minute, func() error {
		got, err := runtimePods()
		if p := got[realNode]; err != nil || p.uid == agentPod.uid || p.lastReason != "OOMKilled" {
			return fmt.Errorf("%+v %v", p, err)
		}
		return nil
	})
	untouched("the agent's OOM kills")

	// ## Rollback: to the pinned release, then the roll.
	must("helm rollback imp 1 -n imp-system", "Rollback was a success")
	must("kubectl -n imp-system get ds imp-runtime -o jsonpath='{.spec.template.spec.containers[0].image}'", agentImage)
	must("helm history imp -n imp-system", "Rollback to 1")
	old, _ := runtimePods()
	must("kubectl -n imp-system delete pod -l app.kubernetes.io/name=imp-runtime --field-selector spec.nodeName="+realNode, "deleted")
	agentPod = agentReady(agentImage, old[realNode].uid)
	untouched("helm rollback and its roll")
	vmReady("helm rollback")

	// The agent crashing: killed twice, restarted by the kubelet each time.
	for i := 1; i <= 2; i++ {
		// The agent of that pod: the imp-agent process in the pod's cgroups.
		procs, _ := filepath.Glob("/proc/[0-9]*/comm")
		killed := 0
		for _, c := range procs {
			comm, _ := os.ReadFile(c)
			cg, _ := os.ReadFile(filepath.Join(filepath.Dir(c), "cgroup"))
			if strings.TrimSpace(string(comm)) == "imp-agent" && strings.Contains(string(cg), "pod"+agentPod.uid) {
				var pid int
				fmt.Sscan(filepath.Base(filepath.Dir(c)), &pid)
				if syscall.Kill(pid, syscall.SIGKILL) == nil {
					killed++
				}
			}
		}
		if killed != 1 {
			t.Fatalf("killed %d agent processes of pod %s, want 1", killed, agentPod.name)
		}
		eventually("the agent restarted", 2*time.Minute, func() error {
			got, err := runtimePods()
			if p := got[realNode]; err != nil || p.uid != agentPod.uid || p.restarts != fmt.Sprint(i) || p.ready != "True" {
				return fmt.Errorf("%+v %v", p, err)
			}
			return nil
		})
	}
	untouched("two crashes of the agent")
	vmReady("two crashes of the agent")

	// ## Volumes (docs/volumes.md): PersistentVolumeClaims through the real node's kubelet.
	if vmmKind == "" || vmmKind == "qemu" {
		checkVolumes(t, sh, must, eventually, tmp, realNode, ref.String())
		untouched("VMs with volumes beside it")
	}

	// The pull alternative of the install.
	must("helm pull "+chart+" --version 0.9.0 --plain-http", "")
	must("helm upgrade --install imp ./imp-0.9.0.tgz -n imp-system --create-namespace"+valueFiles, "STATUS: deployed")

	// A failing preflight blocks the upgrade, with its reason visible and the release unchanged:
	// a pinned kernel hash that is not the node's kernel's.
	bad := strings.Repeat("0", 64)
	out, err = sh(helmInstall + valueFiles + " --set agent.image.digest= --set guest.kernel.sha256=" + bad + " --timeout 2m")
	if err == nil || !strings.Contains(out, "pre-upgrade hooks failed") {
		t.Errorf("an upgrade with a failing preflight: %v", err)
	}
	preflightPod := "kubectl -n imp-system get pods -l app.kubernetes.io/name=imp-preflight,imp.dev/node=" + realNode
	must(preflightPod+" -o jsonpath='{.items[*].status.phase}'", "Failed")
	reason := must(preflightPod + " -o jsonpath='{.items[*].status.containerStatuses[0].state.terminated.message}'")
	if !strings.Contains(reason, bad) || !strings.Contains(reason, "kernel") {
		t.Errorf("the failed preflight's reason %q names neither the kernel nor the pin", reason)
	}
	must("kubectl -n imp-system logs -l app.kubernetes.io/name=imp-preflight,imp.dev/node="+realNode, "FAIL")
	must("kubectl -n imp-system get ds imp-runtime -o jsonpath='{.spec.template.spec.containers[0].image}'", agentImage)
	must("helm status imp -n imp-system", "STATUS: failed")
	untouched("a failed upgrade")

	// helm uninstall leaves the VMs (docs/day0.md): the agent and the operator go, the VM and
	// its ImpVM stay; installing again adopts it.
	must("helm uninstall imp -n imp-system --wait --timeout 2m", "uninstalled")
	eventually("the agent's pod gone", 2*time.Minute, func() error {
		if got, err := runtimePods(); err != nil || len(got) != 0 {
			return fmt.Errorf("%v %v", got, err)
		}
		return nil
	})
	untouched("helm uninstall")
	must("kubectl -n demo get impvm hello", "hello")
	must(helmInstall+valueFiles, "STATUS: deployed")
	agentReady(agentImage, "")
	eventually("operator pods after installing again", 3*time.Minute, operatorPods)
	untouched("installing again")
	vmReady("installing again")

	// The VM stops when asked, by the agent that adopted it, and goes away.
	must(`kubectl -n demo patch impvm hello --type merge -p '{"spec":{"runStrategy":"Halted"}}'`, "patched")
	eventually("the sample VM stopped", 3*time.Minute, func() error {
		out, err := sh("kubectl -n demo get impvm hello -o jsonpath='{.status.phase}'")
		if err != nil || out != "Stopped" {
			return fmt.Errorf("phase %q %v", out, err)
		}
		return nil
	})
	if rec, err := vmm.ReadRecord(filepath.Dir(recs[0])); err == nil && rec.Alive() {
		t.Errorf("the VMM %d still runs after the VM stopped", rec.Pid)
	}
	must("kubectl -n demo delete impvm hello --timeout=2m", "impvm.imp.dev \"hello\" deleted")
	must("kubectl get events -A --sort-by=.lastTimestamp | tail -n 50", "imp-system")
	must("kubectl get events -n demo", "Scheduled", "Started", "hello")
}

// lastLine is the last non-empty line of out.
func lastLine(out string) string {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	return lines[len(lines)-1]
}
