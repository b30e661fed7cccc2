package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// A reachability matrix (docs/networking.md, "NetworkPolicy"), as sig-network's NetworkPolicy
// suite does it: pods and VMs in two namespaces, each a server of its name on TCP 8080 (named
// http) and UDP 8081 (named dns), each source probing every destination on both, the whole
// matrix compared with the one expected for each case.

// peerKind is what an entity of the matrix is.
type peerKind int

const (
	isPod peerKind = iota
	isVM
)

// entity is one source and destination of the matrix.
type entity struct {
	name, ns string
	kind     peerKind
	ip       string // the pod's address, the VM's address on its network
	endpoint string // the VM's endpoint address
}

// matrixWorld is the matrix's entities, in order, and how to run a command in each.
type matrixWorld struct {
	t        *testing.T
	env      []string
	dir      string
	entities []entity
	// diagnose, when set, prints what the node did with the traffic, at the first matrix
	// that never converged.
	diagnose func()
}

// protos are the matrix's columns for each destination.
var protos = []string{"tcp:8080", "udp:8081"}

// addr is where src reaches dst: a VM of src's own network at its address, any other VM at
// its endpoint address, a pod at its address.
func addr(src, dst entity) string {
	if dst.kind == isVM && (src.kind != isVM || src.ns != dst.ns) {
		return dst.endpoint
	}
	return dst.ip
}

// target is the prober's target for dst on column c, from src.
func target(src, dst entity, c string) string {
	proto, port, _ := strings.Cut(c, ":")
	return proto + ":" + addr(src, dst) + ":" + port
}

func (w *matrixWorld) command(src entity, args ...string) *exec.Cmd {
	var c *exec.Cmd
	if src.kind == isPod {
		c = exec.Command("kubectl", append([]string{"-n", src.ns, "exec", src.name, "--", "/bin/app"}, args...)...)
	} else {
		c = exec.Command("kubectl", append([]string{"imp", "-n", src.ns, "exec", src.name, "--", "/bin/hello", "tool-reach"}, args...)...)
	}
	c.Env, c.Dir = w.env, w.dir
	return c
}

// probe runs one round: every source at once, each probing every destination on every column.
// seen[src][dst*len(protos)+col] says whether dst answered with its name.
func (w *matrixWorld) probe() [][]bool {
	seen := make([][]bool, len(w.entities))
	var wg sync.WaitGroup
	for i, src := range w.entities {
		seen[i] = make([]bool, len(w.entities)*len(protos))
		wg.Go(func() {
			args := []string{"probe", "1s"}
			for _, dst := range w.entities {
				for _, c := range protos {
					args = append(args, target(src, dst, c))
				}
			}
			out, err := w.command(src, args...).CombinedOutput()
			if err != nil {
				w.t.Logf("probing from %s: %v\n%s", src.name, err, out)
				return
			}
			answered := map[string]string{}
			for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
				if f := strings.Fields(l); len(f) == 2 {
					answered[f[0]] = f[1]
				}
			}
			for j, dst := range w.entities {
				for k, c := range protos {
					seen[i][j*len(protos)+k] = answered[target(src, dst, c)] == dst.name
				}
			}
		})
	}
	wg.Wait()
	return seen
}

// expected is the matrix allow says, on top of what reaches what with no policy.
func (w *matrixWorld) expected(allow func(src, dst entity, col string) bool) [][]bool {
	want := make([][]bool, len(w.entities))
	for i, src := range w.entities {
		want[i] = make([]bool, len(w.entities)*len(protos))
		for j, dst := range w.entities {
			for k, c := range protos {
				switch {
				case i == j: // within the pod or the guest: no policy sees it
					want[i][j*len(protos)+k] = true
				case src.kind == isVM && dst.kind == isVM && src.ns != dst.ns:
					// VMs of two networks meet only through NAT, which the node's rules forbid
					// between its own networks.
				default:
					want[i][j*len(protos)+k] = allow(src, dst, c)
				}
			}
		}
	}
	return want
}

// show prints a matrix, a mismatch marked: "X" reached, "." not, "!x"/"!." where seen differs.
func (w *matrixWorld) show(want, seen [][]bool) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-6s", "")
	for _, dst := range w.entities {
		for _, c := range protos {
			fmt.Fprintf(&b, " %-9s", dst.name+"/"+strings.Split(c, ":")[0])
		}
	}
	b.WriteString("\n")
	for i, src := range w.entities {
		fmt.Fprintf(&b, "%-6s", src.name)
		for j := range want[i] {
			mark := "."
			if seen[i][j] {
				mark = "X"
			}
			if seen[i][j] != want[i][j] {
				mark = "!" + mark
			}
			fmt.Fprintf(&b, " %-9s", mark)
		}
		b.WriteString("\n")
	}
	return b.String()
}

func equalMatrix(a, b [][]bool) bool {
	return slices.EqualFunc(a, b, func(x, y []bool) bool { return slices.Equal(x, y) })
}

// converge probes until the matrix is want, within bound, and fails with both matrices if it
// never is.
func (w *matrixWorld) converge(name string, want [][]bool, bound time.Duration) {
	w.t.Helper()
	start := time.Now()
	var seen [][]bool
	for tries := 1; ; tries++ {
		seen = w.probe()
		if equalMatrix(seen, want) {
			w.t.Logf("matrix %q as expected after %d rounds, %v:\n%s", name, tries, time.Since(start).Round(time.Millisecond), w.show(want, seen))
			return
		}
		if time.Since(start) > bound {
			break
		}
	}
	w.t.Errorf("matrix %q: seen differs from expected (X reached, . not, ! where seen differs):\n%s", name, w.show(want, seen))
	if w.diagnose != nil {
		w.diagnose()
		w.diagnose = nil
	}
}

// netpolCase is one policy set and what it lets through.
type netpolCase struct {
	name     string
	policies string // manifests, applied before and deleted after
	allow    func(src, dst entity, col string) bool
	// status, when set, is what `kubectl imp status va` says of the policies selecting va.
	status string
}

// checkNetworkPolicy runs the matrix: pods px (np-x) and py (np-y) through the node's CNI
// bridge, VMs va and vb on ImpNetwork net of np-x and vc on np-y's (same CIDR), every policy
// case compared as a whole; a policy added and then removed while a pod probes without pause,
// with the time each took to show.
func checkNetworkPolicy(t *testing.T, sh func(string) (string, error), must func(string, ...string) string,
	eventually func(string, time.Duration, func() error), env []string, dir, client, image, node string) {
	t.Helper()
	podCIDR := strings.Trim(must(`kubectl get node `+node+` -o jsonpath='{.spec.podCIDR}'`), "' \n")
	if podCIDR == "" {
		podCIDR = "10.88.0.0/16" // hack/real-node.sh's
	}
	var objs strings.Builder
	for _, ns := range []string{"x", "y"} {
		fmt.Fprintf(&objs, `---
apiVersion: v1
kind: Namespace
metadata: {name: np-%[1]s, labels: {np: "%[1]s"}}
---
apiVersion: imp.dev/v1alpha1
kind: ImpNetwork
metadata: {name: net, namespace: np-%[1]s}
spec:
  cidr: 10.102.0.0/24
  nat: {enabled: true}
  egress: {allow: [{cidr: %[2]s}]}
---
apiVersion: v1
kind: Pod
metadata: {name: p%[1]s, namespace: np-%[1]s, labels: {app: p%[1]s}}
spec:
  nodeName: %[3]s
  containers:
  - name: reach
    image: %[4]s
    command: [/bin/app, serve, p%[1]s, "8080", "8081"]
    ports: [{name: http, containerPort: 8080}, {name: dns, containerPort: 8081, protocol: UDP}]
`, ns, podCIDR, node, client)
	}
	for _, vm := range []struct{ name, ns string }{{"va", "x"}, {"vb", "x"}, {"vc", "y"}} {
		fmt.Fprintf(&objs, `---
apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata: {name: %[1]s, namespace: np-%[2]s, labels: {app: %[1]s}}
spec:
  image: %[3]s
  command: [/bin/hello]
  args: [tool-reach, serve, %[1]s, "8080", "8081"]
  resources: {vcpus: 1, memory: 192Mi}
  diskSize: 64Mi
  nodeSelector: {imp.test/node: %[4]s}
  networkRef: {name: net}
  ports: [{name: http, port: 8080}, {name: dns, port: 8081, protocol: UDP}]
`, vm.name, vm.ns, image, node)
	}
	if err := os.WriteFile(filepath.Join(dir, "netpol-world.yaml"), []byte(objs.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl apply -f netpol-world.yaml")
	w := &matrixWorld{t: t, env: env, dir: dir}
	w.diagnose = func() {
		// The node's routes to the VMs' endpoint addresses and its transit links, the nft
		// chains of the networks, and what the agent said of them.
		for _, c := range []string{
			"for e in 100.72.0.1 100.72.0.2 100.72.0.3; do ip -4 route get $e; done; ip -4 route show proto 0x4a; ip -br link | grep -E 'impe|impb'",
			"nft list tables; nft list ruleset | grep -cE 'impe|dnat'",
			"kubectl get impnetwork -A -o wide; kubectl get impvm -A -o wide",
			"kubectl -n imp-system logs -l app.kubernetes.io/name=imp-runtime --tail=-1 | grep -E 'np-x|np-y|transit|expos|plumb|route' | tail -60",
		} {
			_, _ = sh(c)
		}
	}
	for _, e := range []entity{{name: "px", ns: "np-x"}, {name: "py", ns: "np-y"}, {name: "va", ns: "np-x", kind: isVM}, {name: "vb", ns: "np-x", kind: isVM}, {name: "vc", ns: "np-y", kind: isVM}} {
		eventually(e.name+" serving", 6*time.Minute, func() error {
			if e.kind == isPod {
				out, err := sh("kubectl -n " + e.ns + " get pod " + e.name + " -o jsonpath='{.status.phase} {.status.podIP}'")
				f := strings.Fields(out)
				if err != nil || len(f) != 2 || f[0] != "Running" {
					return fmt.Errorf("%q %v", out, err)
				}
				e.ip = f[1]
				return nil
			}
			out, err := sh("kubectl -n " + e.ns + " get impvm " + e.name + " -o jsonpath='{.status.phase} {.status.ip} {.status.runtime.endpoint}'")
			f := strings.Fields(out)
			if err != nil || len(f) != 3 || f[0] != "Running" {
				return fmt.Errorf("%q %v", out, err)
			}
			e.ip, e.endpoint = f[1], f[2]
			// Its server is up when it answers itself.
			if out, err := w.command(e, "probe", "1s", "tcp:127.0.0.1:8080").CombinedOutput(); err != nil || !strings.Contains(string(out), e.name) {
				return fmt.Errorf("the guest's server: %q %v", out, err)
			}
			return nil
		})
		w.entities = append(w.entities, e)
	}
	byName := map[string]entity{}
	for _, e := range w.entities {
		byName[e.name] = e
	}
	va := byName["va"]
	py := byName["py"]
	is := func(e entity, names ...string) bool { return slices.Contains(names, e.name) }
	tcp := func(c string) bool { return strings.HasPrefix(c, "tcp") }
	// ingressTo: only dst's ingress is limited, to what ok says.
	ingressTo := func(to string, ok func(src entity, col string) bool) func(src, dst entity, col string) bool {
		return func(src, dst entity, col string) bool { return dst.name != to || ok(src, col) }
	}
	all := func(entity, entity, string) bool { return true }
	cases := []netpolCase{
		{name: "no policy", allow: all},
		{name: "default deny ingress", policies: policyYAML("np-x", "deny-in", "{}", "[Ingress]", "", ""),
			allow: func(src, dst entity, _ string) bool { return !is(dst, "va", "vb") }},
		{name: "default deny egress", policies: policyYAML("np-x", "deny-out", "{}", "[Egress]", "", ""),
			allow: func(src, dst entity, _ string) bool { return !is(src, "va", "vb") }},
		{name: "allow from a namespace", policies: policyYAML("np-x", "from-y", "{matchLabels: {app: va}}", "[Ingress]",
			"[{from: [{namespaceSelector: {matchLabels: {np: \"y\"}}}]}]", ""),
			allow: ingressTo("va", func(src entity, _ string) bool { return src.ns == "np-y" })},
		{name: "allow from a pod label", policies: policyYAML("np-x", "from-px", "{matchLabels: {app: va}}", "[Ingress]",
			"[{from: [{podSelector: {matchLabels: {app: px}}}]}]", ""),
			allow: ingressTo("va", func(src entity, _ string) bool { return is(src, "px") })},
		{name: "allow from a VM label", policies: policyYAML("np-x", "from-vb", "{matchLabels: {app: va}}", "[Ingress]",
			"[{from: [{podSelector: {matchLabels: {app: vb}}}]}]", ""),
			allow: ingressTo("va", func(src entity, _ string) bool { return is(src, "vb") })},
		{name: "both selectors", policies: policyYAML("np-x", "from-pods", "{matchLabels: {app: va}}", "[Ingress]",
			"[{from: [{namespaceSelector: {}, podSelector: {matchExpressions: [{key: app, operator: In, values: [px, py]}]}}]}]", ""),
			allow: ingressTo("va", func(src entity, _ string) bool { return is(src, "px", "py") })},
		{name: "ipBlock with except", policies: policyYAML("np-x", "from-block", "{matchLabels: {app: va}}", "[Ingress]",
			fmt.Sprintf("[{from: [{ipBlock: {cidr: %s, except: [%s/32]}}]}]", podCIDR, py.ip), ""),
			allow: ingressTo("va", func(src entity, _ string) bool { return is(src, "px") })},
		{name: "a named port", policies: policyYAML("np-x", "http-only", "{matchLabels: {app: va}}", "[Ingress]",
			"[{ports: [{port: http}]}]", ""),
			allow: ingressTo("va", func(_ entity, col string) bool { return tcp(col) })},
		{name: "endPort", policies: policyYAML("np-x", "udp-range", "{matchLabels: {app: va}}", "[Ingress]",
			"[{ports: [{protocol: UDP, port: 8081, endPort: 8090}]}]", ""),
			allow: ingressTo("va", func(_ entity, col string) bool { return !tcp(col) })},
		{name: "egress to a pod", policies: policyYAML("np-x", "to-px", "{matchLabels: {app: va}}", "[Egress]", "",
			"[{to: [{podSelector: {matchLabels: {app: px}}}]}]"),
			allow: func(src, dst entity, _ string) bool { return !is(src, "va") || is(dst, "px") }},
		{name: "egress to a pod's named port", policies: policyYAML("np-x", "to-px-http", "{matchLabels: {app: va}}", "[Egress]", "",
			"[{to: [{namespaceSelector: {}, podSelector: {}}], ports: [{port: http}]}]"),
			// Every pod and VM: the VMs of va's network have a port named http too.
			allow: func(src, _ entity, col string) bool { return !is(src, "va") || tcp(col) }},
		{name: "two policies add up", policies: policyYAML("np-x", "from-px", "{matchLabels: {app: va}}", "[Ingress]",
			"[{from: [{podSelector: {matchLabels: {app: px}}}]}]", "") + policyYAML("np-x", "from-vb", "{matchLabels: {app: va}}", "[Ingress]",
			"[{from: [{podSelector: {matchLabels: {app: vb}}}], ports: [{protocol: UDP, port: 8081}]}]", ""),
			allow:  ingressTo("va", func(src entity, col string) bool { return is(src, "px") || (is(src, "vb") && !tcp(col)) }),
			status: "ingress isolated, egress open: from-px (Ingress), from-vb (Ingress)"},
		// Attack: a tenant's policies in np-y, one selecting every VM of np-y and one naming
		// the labels of np-x's VMs, change nothing for np-x.
		{name: "another namespace's policies", policies: policyYAML("np-y", "deny-all", "{}", "[Ingress, Egress]", "", "") +
			policyYAML("np-y", "not-theirs", "{matchLabels: {app: va}}", "[Ingress, Egress]", "", ""),
			allow: func(src, dst entity, _ string) bool { return !is(src, "vc") && !is(dst, "vc") }},
	}
	for _, c := range cases {
		file := "netpol-" + strings.Map(func(r rune) rune {
			if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' {
				return r
			}
			return '-'
		}, c.name) + ".yaml"
		if c.policies != "" {
			if err := os.WriteFile(filepath.Join(dir, file), []byte(c.policies), 0o644); err != nil {
				t.Fatal(err)
			}
			must("kubectl apply -f " + file)
		}
		w.converge(c.name, w.expected(c.allow), 30*time.Second)
		if c.status != "" {
			must("kubectl imp -n np-x status va", "NetworkPolicies:", c.status)
		}
		if c.policies != "" {
			must("kubectl delete -f " + file)
		}
	}

	// Egress to a Service's ClusterIP: the node's kube-proxy picks px behind it after va's
	// egress was checked, so the ClusterIP is allowed where px is, and not where it is not.
	must(`kubectl -n np-x create service clusterip px --tcp=80:8080`) // selects app=px
	vip := strings.Trim(must(`kubectl -n np-x get service px -o jsonpath='{.spec.clusterIP}'`), "' \n")
	must(fmt.Sprintf(`kubectl -n np-x patch impnetwork net --type merge -p '{"spec":{"egress":{"allow":[{"cidr":"%s"},{"cidr":"%s/32"}]}}}'`, podCIDR, vip))
	viaService := func(want string) error {
		out, err := w.command(va, "probe", "1s", "tcp:"+vip+":80").CombinedOutput()
		if f := strings.Fields(string(out)); err != nil || len(f) != 2 || f[1] != want {
			return fmt.Errorf("va → %s:80: %q %v, want %s", vip, out, err, want)
		}
		return nil
	}
	eventually("va reaching Service px with no policy", time.Minute, func() error { return viaService("px") })
	for _, c := range []struct{ name, to, want string }{{"to-px", "px", "px"}, {"to-py", "py", "-"}} {
		pol := policyYAML("np-x", c.name, "{matchLabels: {app: va}}", "[Egress]", "",
			fmt.Sprintf("[{to: [{namespaceSelector: {}, podSelector: {matchLabels: {app: %s}}}]}]", c.to))
		if err := os.WriteFile(filepath.Join(dir, "netpol-svc.yaml"), []byte(pol), 0o644); err != nil {
			t.Fatal(err)
		}
		must("kubectl apply -f netpol-svc.yaml")
		eventually("va reaching Service px under egress "+c.name, 30*time.Second, func() error { return viaService(c.want) })
		must("kubectl delete -f netpol-svc.yaml")
	}
	t.Logf("va under egress to px reaches Service px (%s:80) through kube-proxy; under egress to py it does not", vip)

	// A policy added and removed while px probes va without pause: when each shows.
	px := byName["px"]
	w.converge("before the watch", w.expected(all), 30*time.Second)
	deny := policyYAML("np-x", "deny-in", "{matchLabels: {app: va}}", "[Ingress]", "", "")
	if err := os.WriteFile(filepath.Join(dir, "netpol-watch.yaml"), []byte(deny), 0o644); err != nil {
		t.Fatal(err)
	}
	watch := w.command(px, "watch", target(px, va, "tcp:8080"), "50ms", "20s")
	var out strings.Builder
	watch.Stdout = &out
	if err := watch.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second)
	applied := time.Now()
	must("kubectl apply -f netpol-watch.yaml")
	time.Sleep(6 * time.Second)
	deleted := time.Now()
	must("kubectl delete -f netpol-watch.yaml")
	if err := watch.Wait(); err != nil {
		t.Errorf("the watch: %v\n%s", err, out.String())
	}
	var changes []string
	var at []time.Time
	for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		f := strings.Fields(l)
		if len(f) != 2 {
			continue
		}
		ns, _ := strconv.ParseInt(f[0], 10, 64)
		changes, at = append(changes, f[1]), append(at, time.Unix(0, ns))
	}
	if strings.Join(changes, " ") != "ok fail ok" {
		t.Errorf("px probing va while a deny policy came and went: %v, want ok fail ok\n%s", changes, out.String())
	} else {
		t.Logf("a policy added: new connections refused %v after kubectl apply began; removed: admitted %v after kubectl delete began (measured, probes every 50 ms)",
			at[1].Sub(applied).Round(time.Millisecond), at[2].Sub(deleted).Round(time.Millisecond))
	}
	// Gone whatever the checks found: their VMs' vCPUs are the pools' check's.
	must("kubectl delete namespace np-x np-y --timeout=5m")
}

// policyYAML is a NetworkPolicy manifest; ingress and egress are YAML lists or empty.
func policyYAML(ns, name, selector, types, ingress, egress string) string {
	s := fmt.Sprintf("---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: %s, namespace: %s}\nspec:\n  podSelector: %s\n  policyTypes: %s\n", name, ns, selector, types)
	if ingress != "" {
		s += "  ingress: " + ingress + "\n"
	}
	if egress != "" {
		s += "  egress: " + egress + "\n"
	}
	return s
}
