package e2e

import (
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/testcluster"
	"github.com/syscode-labs/imp/internal/testguest"
)

// failStage makes kwok fail a Job's pod that carries the annotation imp-test-exit-message,
// with that message as its container's termination message: kwok runs no container, so this
// is how a preflight failure on a node is staged. Its weight makes kwok prefer it over the
// stock pod-complete stage.
const failStage = `apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-fail-on-request
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Running']
    - key: '.metadata.annotations["imp-test-exit-message"]'
      operator: 'Exists'
  weight: 1000
  next:
    statusTemplate: |
      {{ $now := Now }}
      {{ $msg := index .metadata.annotations "imp-test-exit-message" }}
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: false
        restartCount: 0
        started: false
        state:
          terminated:
            exitCode: 1
            reason: Error
            message: {{ $msg | Quote }}
            finishedAt: {{ $now | Quote }}
            startedAt: {{ $now | Quote }}
      {{ end }}
      phase: Failed
`

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return fmt.Sprint(l.Addr().(*net.TCPAddr).Port)
}

// TestDay0Runbook walks ../shared/spec/day0-runbook.md (docs/day0.md) against the chart: a
// control plane with controller-manager and scheduler, kwok nodes standing for kubelets (two
// labelled imp/enabled=true, one not), the images and the chart pushed to an OCI registry on
// 127.0.0.1, and each command of the runbook run as written, its output checked. The
// checklist's step 5 runs on one more labelled node standing for this machine, with the real
// operator and agent as processes: the runbook's minimal ImpVM boots under QEMU.
func TestDay0Runbook(t *testing.T) {
	if testing.Short() {
		t.Skip("walks the Day-0 runbook on a full control plane")
	}
	bin, err := testcluster.AssetsDir()
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{"kube-controller-manager", "kube-scheduler", "kwok", "helm", "registry"} {
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
	stages := filepath.Join(tmp, "stages.yaml")
	if err := os.WriteFile(stages, []byte(failStage), 0o644); err != nil {
		t.Fatal(err)
	}
	regPort := freePort(t)
	registry := "127.0.0.1:" + regPort
	env := append(os.Environ(), "CP_BIN_DIR="+bin, "WITH_REGISTRY=1", "REGISTRY_PORT="+regPort, "KWOK_EXTRA_STAGES="+stages,
		"ETCD_PORT="+freePort(t), "ETCD_PEER_PORT="+freePort(t), "APISERVER_PORT="+freePort(t), "KCM_PORT="+freePort(t),
		"SCHEDULER_PORT="+freePort(t), "KWOK_PORT="+freePort(t))
	start := exec.Command(filepath.Join(root, "hack/start-control-plane.sh"), state)
	start.Env = env
	if out, err := start.CombinedOutput(); err != nil {
		t.Fatalf("starting the control plane: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		stop := exec.Command(filepath.Join(root, "hack/stop-control-plane.sh"), state, "--purge")
		stop.Env = env
		_ = stop.Run()
	})
	kubeconfig := filepath.Join(state, "kubeconfig")
	env = append(env, "KUBECONFIG="+kubeconfig, "PATH="+bin+":"+os.Getenv("PATH"), "HELM_CACHE_HOME="+filepath.Join(tmp, "helm-cache"),
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

	// Nodes: kwok-a and kwok-b for the pool, kwok-c outside it, and this machine.
	host := "imp-host"
	var nodes strings.Builder
	for _, n := range []string{"kwok-a", "kwok-b", "kwok-c", host} {
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
	for _, n := range []string{"kwok-a", "kwok-b", host} {
		must("kubectl label node "+n+" imp/enabled=true --overwrite", "node/"+n+" labeled")
	}
	out := must("kubectl get nodes -l imp/enabled=true", "kwok-a", "kwok-b", host)
	if strings.Contains(out, "kwok-c") {
		t.Errorf("kwok-c is listed as an IMP node")
	}

	// ## Install (OCI), with the production values of ## Image Digest Pin. The images come from
	// the test's registry; the selectors are written out so that helm get values shows them.
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
	helmInstall := "helm upgrade --install imp " + chart + " --version 0.9.0 -n imp-system --create-namespace --plain-http"
	must(helmInstall+" -f values-production.yaml", "STATUS: deployed", "REVISION: 1")
	// The preflight ran on each labelled node and, having passed, was cleaned up.
	must("kubectl -n imp-system get events --field-selector involvedObject.kind=Job", "imp-preflight-")

	runtimeNodes := func() (map[string]string, error) {
		out, err := sh(`kubectl -n imp-system get pods -l app.kubernetes.io/name=imp-runtime -o jsonpath='{range .items[*]}{.spec.nodeName}={.spec.containers[0].image}={.status.phase}{"\n"}{end}'`)
		if err != nil {
			return nil, err
		}
		got := map[string]string{}
		for _, l := range strings.Fields(out) {
			f := strings.SplitN(l, "=", 3)
			if len(f) == 3 {
				got[f[0]] = f[1] + " " + f[2]
			}
		}
		return got, nil
	}
	agentImage := registry + "/imp-agent@" + digest["imp-agent"]
	eventually("imp-runtime on exactly the labelled nodes", 3*time.Minute, func() error {
		got, err := runtimeNodes()
		if err != nil {
			return err
		}
		for _, n := range []string{"kwok-a", "kwok-b", host} {
			if got[n] != agentImage+" Running" {
				return fmt.Errorf("node %s: %q; all: %v", n, got[n], got)
			}
		}
		if len(got) != 3 {
			return fmt.Errorf("imp-runtime pods on %v, want kwok-a, kwok-b and %s only", got, host)
		}
		return nil
	})
	eventually("operator pods running", 3*time.Minute, func() error {
		out, err := sh("kubectl -n imp-system get pods")
		if err == nil && strings.Count(out, "imp-operator-") == 2 && strings.Count(out, "Running") == 5 {
			return nil
		}
		return fmt.Errorf("%v", err)
	})
	must("helm get values imp -n imp-system | grep -A2 nodeSelector", "nodeSelector:", "imp/enabled: \"true\"")

	// ## Validation Steps
	out = must("kubectl get crd | grep imp", "impvms.imp.dev", "impvmclasses.imp.dev", "impnetworks.imp.dev", "impnodes.imp.dev", "impipaddresses.imp.dev")
	must("kubectl get nodes -l imp/enabled=true", "kwok-a", "kwok-b", host)
	must("kubectl -n imp-system get pods", "imp-operator-", "imp-runtime-")
	must("kubectl -n imp-system get ds imp-runtime -o yaml | grep -A2 updateStrategy", "updateStrategy:", "type: OnDelete")
	must("kubectl get impvm -A -o wide", "No resources found") // none yet: the API answers

	// ## Checklist step 5 on this machine: the real operator and agent as processes, the
	// runbook's minimal ImpVM sample with its image from the test registry.
	kernel, initrd := testguest.Artifacts(t, tmp)
	ref := testguest.Image(t, registry, "hello")
	procs := filepath.Join(tmp, "bin")
	build := exec.Command("go", "build", "-o", procs+"/", "./cmd/imp-operator", "./cmd/imp-agent")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building: %v\n%s", err, out)
	}
	// Each runs as the ServiceAccount the chart made for it, with a token the API server issued:
	// exactly the authority the chart grants, nothing of the admin's. The agent's token is bound
	// to the imp-runtime pod of this node, as the kubelet binds the pod's own, so it names the
	// node and the chart's admission policy lets it write for this node alone.
	runtimePod := strings.TrimSpace(must("kubectl -n imp-system get pod -l app.kubernetes.io/name=imp-runtime --field-selector spec.nodeName=" + host +
		" -o jsonpath={.items[0].metadata.name}/{.items[0].metadata.uid}"))
	podName, podUID, _ := strings.Cut(runtimePod, "/")
	startProc := func(name string, args ...string) {
		bind := ""
		if name == "imp-agent" {
			bind = " --bound-object-kind Pod --bound-object-name " + podName + " --bound-object-uid " + podUID
		}
		token := strings.TrimSpace(must("kubectl -n imp-system create token " + name + " --duration=1h" + bind))
		kc := saKubeconfig(t, kubeconfig, token)
		cmd := exec.Command(filepath.Join(procs, name), append([]string{"--kubeconfig", kc, "--metrics-bind-address", "0",
			"--health-probe-bind-address", "0", "--log-level", "error"}, args...)...)
		log, _ := os.Create(filepath.Join(tmp, name+".log"))
		cmd.Stdout, cmd.Stderr = log, log
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait(); log.Close() })
	}
	agentState := filepath.Join(tmp, "agent")
	// VMs outlive their agent by design: a failed run must not leave its guests behind.
	t.Cleanup(func() {
		dirs, _ := filepath.Glob(filepath.Join(agentState, "vms", "*"))
		for _, d := range dirs {
			vmm.KillMarked(filepath.Base(d), 5*time.Second)
		}
	})
	startProc("imp-operator", "--leader-elect=false")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := l.Addr().String()
	l.Close()
	startProc("imp-agent", "--node-name", host, "--state-dir", agentState, "--netns-dir", filepath.Join(tmp, "netns"), "--kernel", kernel, "--initramfs", initrd,
		"--qemu-accel", "tcg", "--reserve-vcpus", "0", "--reserve-memory", "0", "--vcpu-overcommit", "4", "--cgroup-root", "",
		"--metrics-bind-address", metricsAddr)
	t.Cleanup(func() { killVMMs(agentState) })

	// The agent, in the host's network on a real node, serves its metrics to those the API
	// server authorizes: nobody without a token, not the agent's own, a reader bound to the
	// chart's imp-metrics-reader.
	must("kubectl -n imp-system create serviceaccount prometheus", "serviceaccount/prometheus created")
	must("kubectl create clusterrolebinding imp-metrics-prometheus --clusterrole imp-metrics-reader --serviceaccount imp-system:prometheus", "created")
	scrape := func(token string) (int, string) {
		c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // the agent's certificate is self-signed
		req, _ := http.NewRequest("GET", "https://"+metricsAddr+"/metrics", nil)
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
	var code int
	var body string
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if code, body = scrape(reader); code == http.StatusOK {
			break
		}
	}
	if code != http.StatusOK || !strings.Contains(body, "controller_runtime_reconcile_total") {
		t.Errorf("the metrics reader got %d: %.300s", code, body)
	}
	if code, _ := scrape(""); code != http.StatusUnauthorized {
		t.Errorf("a scrape without a token got %d, want 401", code)
	}
	if code, _ := scrape(strings.TrimSpace(must("kubectl -n imp-system create token imp-operator --duration=10m"))); code != http.StatusForbidden {
		t.Errorf("a scrape with a token not allowed /metrics got %d, want 403", code)
	}

	sample, err := os.ReadFile(filepath.Join(root, "config/samples/imp_v1alpha1_impvm.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var vm map[string]any
	if err := yaml.Unmarshal(sample, &vm); err != nil {
		t.Fatal(err)
	}
	spec := vm["spec"].(map[string]any)
	spec["image"], spec["command"], spec["args"] = ref.String(), []string{"/bin/hello"}, []string{"serve"}
	spec["nodeSelector"] = map[string]any{"imp.test/node": host}
	data, _ := yaml.Marshal(vm)
	if err := os.WriteFile(filepath.Join(tmp, "hello.yaml"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl create namespace demo", "namespace/demo created")
	must("kubectl -n demo apply -f hello.yaml", "impvm.imp.dev/hello created")
	eventually("the sample VM Running and Ready", 9*time.Minute, func() error {
		out, err := sh("kubectl -n demo get impvm hello -o jsonpath='{.status.phase} {.status.conditions[?(@.type==\"Ready\")].status} {.status.nodeName}'")
		if err != nil || out != "Running True "+host {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	})
	must("kubectl get impvm -A -o wide", "hello", "Running", host)
	must(`kubectl -n demo patch impvm hello --type merge -p '{"spec":{"runStrategy":"Halted"}}'`, "patched")
	eventually("the sample VM stopped", 6*time.Minute, func() error {
		out, err := sh("kubectl -n demo get impvm hello -o jsonpath='{.status.phase}'")
		if err != nil || out != "Stopped" {
			return fmt.Errorf("phase %q %v", out, err)
		}
		return nil
	})
	must("kubectl -n demo delete impvm hello --timeout=2m", "impvm.imp.dev \"hello\" deleted")
	out = must("kubectl get events -A --sort-by=.lastTimestamp | tail -n 50", "Scheduled", "Started")
	if !strings.Contains(out, "hello") {
		t.Errorf("no Event about the sample VM in the last 50")
	}

	// ## Runtime OnDelete: an upgrade that changes the agent image replaces no imp-runtime pod.
	before, _ := runtimeNodes()
	must(helmInstall+" -f values-production.yaml --set agent.image.digest= --set agent.image.tag=0.9.0", "STATUS: deployed", "REVISION: 2")
	newImage := registry + "/imp-agent:0.9.0"
	must("kubectl -n imp-system get ds imp-runtime -o jsonpath='{.spec.template.spec.containers[0].image}'", newImage)
	time.Sleep(5 * time.Second)
	if after, _ := runtimeNodes(); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Errorf("imp-runtime pods changed on upgrade: %v, then %v", before, after)
	}
	// The roll procedure, on kwok-a.
	must("kubectl cordon kwok-a", "cordoned")
	must("kubectl drain kwok-a --ignore-daemonsets --delete-emptydir-data", "drained")
	must("kubectl -n imp-system delete pod -l app.kubernetes.io/name=imp-runtime --field-selector spec.nodeName=kwok-a", "deleted")
	must("kubectl uncordon kwok-a", "uncordoned")
	eventually("kwok-a rolled, kwok-b not", 3*time.Minute, func() error {
		got, err := runtimeNodes()
		if err != nil || got["kwok-a"] != newImage+" Running" || got["kwok-b"] != agentImage+" Running" {
			return fmt.Errorf("%v %v", got, err)
		}
		return nil
	})

	// The pull alternative, then helm rollback to the digest-pinned release.
	must("helm pull "+chart+" --version 0.9.0 --plain-http", "")
	must("helm upgrade --install imp ./imp-0.9.0.tgz -n imp-system --create-namespace -f values-production.yaml --set agent.image.digest= --set agent.image.tag=0.9.0", "REVISION: 3")
	must("helm rollback imp 1 -n imp-system", "Rollback was a success")
	must("kubectl -n imp-system get ds imp-runtime -o jsonpath='{.spec.template.spec.containers[0].image}'", agentImage)
	must("helm history imp -n imp-system", "Rollback to 1")

	// A failing preflight blocks the upgrade, with its reason visible and the release unchanged.
	const reason = "preflight failed: kvm: opening /dev/kvm: no such file or directory"
	out, err = sh(helmInstall + " -f values-production.yaml --set agent.image.digest= --set-string kvm.preflight.podAnnotations.imp-test-exit-message='" + reason + "' --timeout 2m")
	if err == nil || !strings.Contains(out, "pre-upgrade hooks failed") {
		t.Errorf("an upgrade with a failing preflight: %v", err)
	}
	must("kubectl -n imp-system get pods -l app.kubernetes.io/name=imp-preflight -o jsonpath='{.items[*].status.containerStatuses[0].state.terminated.message}'", reason)
	must("kubectl -n imp-system get ds imp-runtime -o jsonpath='{.spec.template.spec.containers[0].image}'", agentImage)
	must("helm status imp -n imp-system", "STATUS: failed")
}

// killVMMs kills every VMM recorded under an agent's state directory: a failed test must not
// leave guests running.
func killVMMs(stateDir string) {
	recs, _ := filepath.Glob(filepath.Join(stateDir, "vms", "*", vmm.RecordFile))
	for _, p := range recs {
		if rec, err := vmm.ReadRecord(filepath.Dir(p)); err == nil && rec.Alive() {
			_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
		}
	}
}

// saKubeconfig writes a kubeconfig for the cluster of admin (a kubeconfig's path) that
// authenticates with a ServiceAccount's token, and returns its path.
func saKubeconfig(t *testing.T, admin, token string) string {
	t.Helper()
	cfg, err := clientcmd.LoadFromFile(admin)
	if err != nil {
		t.Fatal(err)
	}
	for name := range cfg.AuthInfos {
		cfg.AuthInfos[name] = &clientcmdapi.AuthInfo{Token: token}
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}
