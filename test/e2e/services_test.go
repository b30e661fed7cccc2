package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"
)

// checkServices puts two VMs behind Services on the real node, with the node's kube-proxy
// (nftables mode) and CoreDNS (hack/real-node.sh): web-a and web-b of a Deployment-like label
// on a closed ImpNetwork, declaring port 8080 (named http) with an HTTP readiness probe. A pod
// on the real node fetches http://web.web.svc.cluster.local/ forty times and both VMs answer; a
// NodePort reaches them from the node; a headless Service resolves one A record per ready VM,
// which are the VMs' endpoint addresses.
//
// It returns the pods' client image (devtool), which later checks use too.
func checkServices(t *testing.T, sh func(string) (string, error), must func(string, ...string) string,
	eventually func(string, time.Duration, func() error), dir, root, registry, image, node string) (client string) {
	t.Helper()
	run := sh
	// The pods' client: devtool's fetch and resolve, as an image of its own.
	devtool := filepath.Join(dir, "devtool")
	build := exec.Command("go", "build", "-o", devtool, "./hack/devtool")
	build.Dir, build.Env = root, append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building devtool: %v\n%s", err, out)
	}
	client = registry + "/imp-node/client:1"
	must(devtool + " image " + client + " " + devtool)

	var objs strings.Builder
	fmt.Fprintf(&objs, `apiVersion: imp.dev/v1alpha1
kind: ImpNetwork
metadata: {name: web, namespace: web}
spec: {cidr: 10.101.0.0/24}
`)
	for _, n := range []string{"web-a", "web-b"} {
		fmt.Fprintf(&objs, `---
apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata: {name: %s, namespace: web, labels: {app: web}}
spec:
  image: %s
  command: [/bin/hello]
  args: [web]
  resources: {vcpus: 1, memory: 192Mi}
  diskSize: 64Mi
  nodeSelector: {imp.test/node: %s}
  networkRef: {name: web}
  ports: [{name: http, port: 8080}]
  readinessProbe: {httpGet: {path: /healthz, port: http}, periodSeconds: 1, failureThreshold: 1}
`, n, image, node)
	}
	objs.WriteString(`---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: web}
spec:
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: http}]
---
apiVersion: v1
kind: Service
metadata: {name: web-np, namespace: web}
spec:
  type: NodePort
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: web-headless, namespace: web}
spec:
  clusterIP: None
  selector: {app: web}
  ports: [{name: http, port: 8080}]
`)
	if err := os.WriteFile(filepath.Join(dir, "web.yaml"), []byte(objs.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl create namespace web")
	must("kubectl apply -f web.yaml")

	// Both VMs ready endpoints of the Service (IMP's slice beside the cluster's empty one).
	var endpoints []string
	eventually("two ready endpoints of Service web", 6*time.Minute, func() error {
		out, err := run(`kubectl -n web get endpointslices -l kubernetes.io/service-name=web,endpointslice.kubernetes.io/managed-by=imp.dev ` +
			`-o jsonpath='{range .items[*].endpoints[*]}{.addresses[0]} {.conditions.ready} {.targetRef.name}{"\n"}{end}'`)
		lines := strings.Fields(strings.ReplaceAll(strings.TrimSpace(out), "\n", " | "))
		if err != nil || strings.Count(out, " true ") != 2 {
			return fmt.Errorf("%v: %v", err, lines)
		}
		endpoints = nil
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			endpoints = append(endpoints, strings.Fields(l)[0])
		}
		sort.Strings(endpoints)
		return nil
	})
	must("kubectl -n web get impvm -o wide")
	must("kubectl -n web get endpointslices")

	pod := func(name string, args ...string) string {
		t.Helper()
		quoted := make([]string, len(args))
		for i, a := range args {
			quoted[i] = fmt.Sprintf("%q", a)
		}
		spec := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: web}
spec:
  nodeName: %s
  restartPolicy: Never
  containers: [{name: client, image: %s, command: [/bin/app, %s]}]
`, name, node, client, strings.Join(quoted, ", "))
		if err := os.WriteFile(filepath.Join(dir, name+".yaml"), []byte(spec), 0o644); err != nil {
			t.Fatal(err)
		}
		must("kubectl apply -f " + name + ".yaml")
		eventually("pod "+name+" done", 3*time.Minute, func() error {
			out, err := run("kubectl -n web get pod " + name + " -o jsonpath='{.status.phase}'")
			if err != nil || (out != "Succeeded" && out != "Failed") {
				return fmt.Errorf("phase %q %v", out, err)
			}
			return nil
		})
		out := must("kubectl -n web logs " + name)
		if phase, _ := run("kubectl -n web get pod " + name + " -o jsonpath='{.status.phase}'"); phase != "Succeeded" {
			t.Errorf("pod %s %s: %s", name, phase, out)
		}
		return out
	}
	// ClusterIP by its DNS name: both VMs answer.
	out := pod("fetch", "fetch", "http://web.web.svc.cluster.local/", "40")
	for _, n := range []string{"web-a", "web-b"} {
		if !regexp.MustCompile(`\d+× hello from ` + n).MatchString(out) {
			t.Errorf("VM %s never answered through Service web: %q", n, out)
		}
	}
	// Headless: one A record per ready VM, its endpoint address.
	out = pod("resolve", "resolve", "web-headless.web.svc.cluster.local")
	if got := strings.Fields(out); strings.Join(got, " ") != strings.Join(endpoints, " ") {
		t.Errorf("web-headless resolves to %v, want the VMs' endpoints %v", got, endpoints)
	}
	// NodePort from the node itself.
	nodeIP := strings.Trim(must(`kubectl get node `+node+` -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}'`), "' \n")
	port := strings.Trim(must(`kubectl -n web get svc web-np -o jsonpath='{.spec.ports[0].nodePort}'`), "' \n")
	// What answered each try, with its HTTP status, so that a failure says what answered
	// instead of the VMs (CI once saw thirty empty answers that curl took for success).
	seen, other := map[string]bool{}, map[string]int{}
	for i := 0; i < 30 && !(seen["hello from web-a"] && seen["hello from web-b"]); i++ {
		o, err := run("curl -s --max-time 5 -w '\n%{http_code}' http://" + nodeIP + ":" + port + "/")
		body, how := o, ""
		if j := strings.LastIndex(o, "\n"); j >= 0 {
			body, how = o[:j], o[j+1:]
		}
		if err == nil && how == "200" {
			seen[strings.TrimSpace(body)] = true
		} else {
			other[fmt.Sprintf("%q %s (%v)", body, how, err)]++
		}
	}
	if !seen["hello from web-a"] || !seen["hello from web-b"] {
		t.Errorf("NodePort %s:%s from the node reached %v, want both VMs; other answers: %v", nodeIP, port, seen, other)
		// Where the node sends the endpoints' traffic (by eth0: its route to them is lost),
		// and kube-proxy's rules for the port.
		for _, c := range []string{
			"for a in " + strings.Join(endpoints, " ") + "; do ip -4 route get $a; done; ip -4 route show proto 0x4a; ip -br link | grep impe",
			"nft list table ip kube-proxy | grep -F " + port,
			"curl -s --max-time 5 -w ' %{http_code}' http://" + endpoints[0] + ":8080/",
			"kubectl -n imp-system logs -l app.kubernetes.io/name=imp-runtime --tail=-1 | grep -iE 'transit|expos|plumb|route' | tail -40",
		} {
			_, _ = run(c)
		}
	}
	checkIdle(t, run, must, eventually, dir, image, node, pod)
	must("kubectl delete namespace web --timeout=5m") // its VMs go through their agent
	return client
}

// checkIdle (docs/suspend.md, "Idle VMs"): a VM of namespace web serving HTTP behind a
// ClusterIP Service, suspended after 10 s without activity (reason Idle), stays a ready
// endpoint; a GET through the Service from a pod on the real node, made once, is answered by
// the VM, woken; idle again, so is a curl from the node itself through the real kube-proxy.
func checkIdle(t *testing.T, run func(string) (string, error), must func(string, ...string) string,
	eventually func(string, time.Duration, func() error), dir, image, node string, pod func(string, ...string) string) {
	t.Helper()
	spec := fmt.Sprintf(`apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata: {name: idle, namespace: web, labels: {app: idle}}
spec:
  image: %s
  command: [/bin/hello]
  args: [web]
  resources: {vcpus: 1, memory: 192Mi}
  diskSize: 64Mi
  nodeSelector: {imp.test/node: %s}
  networkRef: {name: web}
  ports: [{name: http, port: 8080}]
  idle: {suspendAfter: 10s}
---
apiVersion: v1
kind: Service
metadata: {name: idle, namespace: web}
spec:
  selector: {app: idle}
  ports: [{name: http, port: 80, targetPort: http}]
`, image, node)
	if err := os.WriteFile(filepath.Join(dir, "idle.yaml"), []byte(spec), 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl apply -f idle.yaml")
	suspended := func() error {
		out, err := run(`kubectl -n web get impvm idle -o jsonpath='{.status.phase} {.status.suspension.reason}'`)
		if err != nil || out != "Suspended Idle" {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	}
	eventually("VM idle suspended because it was idle", 6*time.Minute, suspended)
	// Still a ready endpoint of its Service: what arrives through it wakes it.
	out := must(`kubectl -n web get endpointslices -l kubernetes.io/service-name=idle,endpointslice.kubernetes.io/managed-by=imp.dev ` +
		`-o jsonpath='{range .items[*].endpoints[*]}{.conditions.ready}{end}'`)
	if strings.Trim(out, "' \n") != "true" {
		t.Errorf("the idle-suspended VM's endpoint is not ready: %q", out)
	}
	// What the node did with the traffic, when the VM did not answer: its route to the
	// endpoint address (lost: the packets leave by eth0), kube-proxy's rules for the Service,
	// and what the agent said of the VM.
	diagnose := func() {
		ep := strings.Trim(must(`kubectl -n web get endpointslices -l kubernetes.io/service-name=idle,endpointslice.kubernetes.io/managed-by=imp.dev `+
			`-o jsonpath='{.items[*].endpoints[*].addresses[*]}'`), "' \n")
		ip := strings.Trim(must(`kubectl -n web get svc idle -o jsonpath='{.spec.clusterIP}'`), "' \n")
		for _, c := range []string{
			"kubectl -n web get impvm idle -o jsonpath='{.status.runtime}'",
			"ip -4 route get " + ep + "; ip -4 route show proto 0x4a; ip -br link | grep impe",
			"nft list table ip kube-proxy | grep -cF " + ip,
			"kubectl -n imp-system logs -l app.kubernetes.io/name=imp-runtime --tail=-1 | grep -iE 'idle|stand|transit|expos|wak' | tail -40",
		} {
			_, _ = run(c)
		}
	}
	got := pod("wake", "get", "http://idle.web.svc.cluster.local/")
	if !strings.HasPrefix(got, "hello from idle (") {
		t.Errorf("a GET through Service idle from a pod, once, to the idle-suspended VM: %q", got)
		diagnose()
	}
	t.Logf("woken through a Service from a pod: %s", strings.TrimSpace(got))
	must("kubectl -n web get impvm idle -o wide")
	must("kubectl -n web get events --field-selector involvedObject.name=idle", "Waking")

	eventually("VM idle suspended again", 3*time.Minute, suspended)
	out = must(`kubectl -n web get endpointslices -l kubernetes.io/service-name=idle,endpointslice.kubernetes.io/managed-by=imp.dev ` +
		`-o jsonpath='{range .items[*].endpoints[*]}{.conditions.ready}{end}'`)
	if strings.Trim(out, "' \n") != "true" {
		t.Errorf("the idle-suspended VM's endpoint is not ready: %q", out)
	}
	ip := strings.Trim(must(`kubectl -n web get svc idle -o jsonpath='{.spec.clusterIP}'`), "' \n")
	o, err := run("curl -s --max-time 60 -w ' %{http_code} %{time_total}s' http://" + ip + "/")
	if err != nil || !strings.HasPrefix(o, "hello from idle") || !strings.Contains(o, " 200 ") {
		t.Errorf("curl from the node through Service idle (%s), once, to the idle-suspended VM: %q, %v", ip, o, err)
		diagnose()
	}
	t.Logf("woken through a Service from the node: %s", o)
}
