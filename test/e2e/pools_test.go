package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

// checkPools runs an ImpVMPool of real guests on the real node behind a Service (docs/pools.md):
// kubectl scale to 5 gives five Ready members and five ready endpoints; scale to 2 removes the
// three newest; at 3 replicas a new image rolls through with maxUnavailable 1 while the
// Service's ready endpoints, read every 100 ms, never drop below 2; `kubectl imp rollout undo`
// returns to the first image; a member whose VMM is killed runs again; an HPA on an external
// metric moves the pool; and the operator killed with SIGKILL during a scale from 0 to 150 ends
// with exactly 150 members.
func checkPools(t *testing.T, sh func(string) (string, error), must func(string, ...string) string,
	eventually func(string, time.Duration, func() error), dir, node, image, image2 string) {
	t.Helper()
	pool := func(name string, replicas int, image, selector string) string {
		return fmt.Sprintf(`apiVersion: imp.dev/v1alpha1
kind: ImpVMPool
metadata: {name: %s, namespace: pools}
spec:
  replicas: %d
  selector: {matchLabels: {app: %s}}
  minReadySeconds: 2
  updateStrategy: {type: RollingUpdate, rollingUpdate: {maxUnavailable: 1, maxSurge: 0}}
  template:
    metadata: {labels: {app: %s}}
    spec:
      image: %s
      command: [/bin/hello]
      args: [web]
      resources: {vcpus: 1, memory: 160Mi}
      diskSize: 64Mi
      nodeSelector: {imp.test/node: %s}
      networkRef: {name: pool}
      terminationGracePeriodSeconds: 2
      ports: [{name: http, port: 8080}]
      readinessProbe: {httpGet: {path: /healthz, port: http}, periodSeconds: 1, failureThreshold: 1}
`, name, replicas, name, name, image, selector)
	}
	objs := `apiVersion: imp.dev/v1alpha1
kind: ImpNetwork
metadata: {name: pool, namespace: pools}
spec: {cidr: 10.102.0.0/24}
---
` + pool("web", 2, image, node) + `---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: pools}
spec:
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: http}]
`
	if err := os.WriteFile(filepath.Join(dir, "pool.yaml"), []byte(objs), 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl create namespace pools")
	must("kubectl apply -f pool.yaml", "impnetwork.imp.dev/pool created", "impvmpool.imp.dev/web created", "service/web created")

	readyEndpoints := func() (int, error) {
		out, err := sh(`kubectl -n pools get endpointslices -l kubernetes.io/service-name=web,endpointslice.kubernetes.io/managed-by=imp.dev ` +
			`-o jsonpath='{range .items[*].endpoints[*]}{.conditions.ready} {end}'`)
		return strings.Count(out, "true"), err
	}
	members := func() []string { // those not being deleted
		out, _ := sh("kubectl -n pools get impvm -l app=web -o jsonpath='{range .items[*]}{.metadata.name}:{.metadata.deletionTimestamp} {end}'")
		var f []string
		for _, m := range strings.Fields(out) {
			if name, deleting, _ := strings.Cut(m, ":"); deleting == "" {
				f = append(f, name)
			}
		}
		sort.Strings(f)
		return f
	}
	// What the pool's members, the node and the agent said, when the pool did not settle.
	diagnosed := false
	diagnose := func() {
		if diagnosed {
			return
		}
		diagnosed = true
		for _, c := range []string{
			"kubectl get impvm -A -o wide",
			`kubectl -n pools get impvm -o jsonpath='{range .items[*]}{.metadata.name} {.status.phase} {.status.nodeName} ` +
				`{range .status.conditions[*]}{.type}={.status}/{.reason} {.lastTransitionTime}: {.message}; {end}{"\n"}{end}'`,
			"kubectl -n pools get impvmpool web -o jsonpath='{.status}'",
			"kubectl get impnode " + node + " -o jsonpath='{.status}'",
			"kubectl -n pools get events --sort-by=.lastTimestamp | tail -40",
			`kubectl -n imp-system logs -l app.kubernetes.io/name=imp-runtime --tail=-1 | grep -E 'pools/|"pools"' | tail -60`,
		} {
			_, _ = sh(c)
		}
	}
	settled := func(replicas int, image string) {
		t.Helper()
		const within = 8 * time.Minute
		begun := time.Now()
		eventually(fmt.Sprintf("%d members of %s available, as many ready endpoints", replicas, image), within, func() (err error) {
			defer func() {
				if err != nil && time.Since(begun) >= within {
					diagnose()
				}
			}()
			out, err := sh("kubectl -n pools get impvmpool web -o jsonpath='{.status.replicas} {.status.availableReplicas} {.status.updatedReplicas}'")
			want := fmt.Sprintf("%d %d %d", replicas, replicas, replicas)
			if err != nil || strings.TrimSpace(out) != want {
				return fmt.Errorf("replicas available updated %q, want %q (%v)", out, want, err)
			}
			imgs, _ := sh("kubectl -n pools get impvm -l app=web -o jsonpath='{range .items[*]}{.spec.image} {end}'")
			if f := strings.Fields(imgs); len(f) != replicas || strings.Count(imgs, image+" ") != replicas {
				return fmt.Errorf("images %q", imgs)
			}
			if n, err := readyEndpoints(); err != nil || n != replicas {
				return fmt.Errorf("%d ready endpoints %v", n, err)
			}
			return nil
		})
	}
	settled(2, image)
	must("kubectl scale impvmpool/web -n pools --replicas 5", "impvmpool.imp.dev/web scaled")
	settled(5, image)
	must("kubectl -n pools get impvmpool web", "web", "5")
	if got := members(); strings.Join(got, " ") != "web-0 web-1 web-2 web-3 web-4" {
		t.Errorf("members %v", got)
	}
	// Scale-in: all Ready and of one revision, so the newest go: the three made last.
	must("kubectl scale impvmpool/web -n pools --replicas 2", "scaled")
	settled(2, image)
	if got := members(); strings.Join(got, " ") != "web-0 web-1" {
		t.Errorf("after scale-in to 2, members %v, want web-0 web-1 (the newest removed)", got)
	}
	must("kubectl scale impvmpool/web -n pools --replicas 3", "scaled")
	settled(3, image)

	// A new image rolls through; the Service keeps at least 2 of 3 ready endpoints, read every
	// 100 ms.
	var mu sync.Mutex
	lowest, reads := 3, 0
	stop := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			if n, err := readyEndpoints(); err == nil {
				mu.Lock()
				lowest, reads = min(lowest, n), reads+1
				mu.Unlock()
			}
		}
	}()
	if err := os.WriteFile(filepath.Join(dir, "pool2.yaml"), []byte(pool("web", 3, image2, node)), 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl apply -f pool2.yaml", "impvmpool.imp.dev/web configured")
	must("kubectl imp -n pools rollout status impvmpool/web --timeout 8m", `impvmpool "web" successfully rolled out`)
	settled(3, image2)
	close(stop)
	<-watched
	t.Logf("during the rollout the Service had at least %d ready endpoints (%d reads)", lowest, reads)
	if lowest < 2 {
		t.Errorf("during the rollout the Service fell to %d ready endpoints (maxUnavailable 1 of 3)", lowest)
	}
	must("kubectl imp -n pools rollout history impvmpool/web", image, image2+"  (current)")
	must("kubectl imp -n pools rollout undo impvmpool/web", `impvmpool "web" rolled back to revision 1`)
	must("kubectl imp -n pools rollout status impvmpool/web --timeout 8m", "successfully rolled out")
	settled(3, image)

	// A member's VMM killed: the member runs again (its runStrategy restarts it in place).
	members0 := members()[0]
	uid := strings.TrimSpace(must("kubectl -n pools get impvm " + members0 + " -o jsonpath='{.metadata.uid}'"))
	pid := strings.TrimSpace(must("pgrep -f 'qemu-system.*" + uid + "' | head -1"))
	if pid == "" {
		t.Fatalf("no VMM process of %s", members0)
	}
	must("kill -KILL " + pid)
	eventually(members0+" restarted and Ready", 4*time.Minute, func() error {
		out, err := sh("kubectl -n pools get impvm " + members0 + " -o jsonpath='{.status.restartCount} {.status.conditions[?(@.type==\"Ready\")].status}'")
		if err != nil || !strings.HasSuffix(strings.TrimSpace(out), "True") || strings.HasPrefix(out, "0 ") || strings.HasPrefix(out, " ") {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	})
	settled(3, image)

	// An HPA on an external metric (a fake adapter, as KEDA serves one) moves replicas through
	// the scale subresource, and the pool follows. Its members wait for a node that does not
	// exist: what is checked is the count.
	nodeIP := strings.TrimSpace(must("kubectl get node " + node + ` -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}'`))
	metrics := serveExternalMetrics(t, nodeIP, "queue_depth")
	metrics.value.Store(4)
	hpa := pool("queued", 1, image, "nowhere") + `---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata: {name: queued, namespace: pools}
spec:
  scaleTargetRef: {apiVersion: imp.dev/v1alpha1, kind: ImpVMPool, name: queued}
  minReplicas: 1
  maxReplicas: 8
  metrics: [{type: External, external: {metric: {name: queue_depth}, target: {type: AverageValue, averageValue: "1"}}}]
  behavior: {scaleDown: {stabilizationWindowSeconds: 0}, scaleUp: {stabilizationWindowSeconds: 0}}
---
` + metrics.objects("pools", nodeIP)
	if err := os.WriteFile(filepath.Join(dir, "hpa.yaml"), []byte(hpa), 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl apply -f hpa.yaml", "horizontalpodautoscaler.autoscaling/queued created", "apiservice.apiregistration.k8s.io/v1beta1.external.metrics.k8s.io created")
	following := func(want int) {
		t.Helper()
		eventually(fmt.Sprintf("the HPA sets %d replicas and the pool follows", want), 3*time.Minute, func() error {
			out, err := sh("kubectl -n pools get impvmpool queued -o jsonpath='{.spec.replicas} {.status.replicas}'")
			if n, _ := sh("kubectl -n pools get impvm -l app=queued -o name | wc -l"); err != nil ||
				strings.TrimSpace(out) != fmt.Sprintf("%d %d", want, want) || strings.TrimSpace(n) != fmt.Sprint(want) {
				hpaState, _ := sh("kubectl -n pools get hpa queued -o jsonpath='{.status}'")
				return fmt.Errorf("spec/status replicas %q, members %q: %v; hpa %s", out, n, err, hpaState)
			}
			return nil
		})
	}
	following(4)
	metrics.value.Store(2)
	following(2)
	must("kubectl delete -f hpa.yaml --timeout=2m", "deleted")

	// The operator killed during a scale from 0 to 150 (members that wait for a node that does
	// not exist: the figure is the count): exactly 150 members in the end. The namespace's pools
	// make a burst of 100 members at once and the rest at 20 a second (the operator's defaults):
	// the kill lands while the pool waits for the budget of the last 50, seconds long, where a
	// scale within the burst is over between two reads of the count.
	if err := os.WriteFile(filepath.Join(dir, "many.yaml"), []byte(pool("many", 0, image, "nowhere")), 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl apply -f many.yaml", "impvmpool.imp.dev/many created")
	must("kubectl scale impvmpool/many -n pools --replicas 150", "scaled")
	count := func() int {
		out, _ := sh("kubectl -n pools get impvm -l app=many -o name | wc -l")
		var n int
		_, _ = fmt.Sscan(strings.TrimSpace(out), &n)
		return n
	}
	eventually("the scale under way", time.Minute, func() error {
		if n := count(); n < 3 || n >= 150 {
			return fmt.Errorf("%d members", n)
		}
		return nil
	})
	// The operator's process, not a volume holder's (`imp-operator hold`).
	must(`for p in $(pgrep -x imp-operator); do tr '\0' ' ' </proc/$p/cmdline | grep -q ' hold' || kill -KILL $p; done; echo killed`, "killed")
	eventually("exactly 150 members", 4*time.Minute, func() error {
		out, err := sh("kubectl -n pools get impvmpool many -o jsonpath='{.status.replicas}'")
		if n := count(); n != 150 || err != nil || strings.TrimSpace(out) != "150" {
			return fmt.Errorf("%d members, status.replicas %q %v", n, out, err)
		}
		return nil
	})
	time.Sleep(5 * time.Second)
	if n := count(); n != 150 {
		t.Errorf("%d members after the operator's restart settled, want 150", n)
	}
	must("kubectl delete namespace pools --timeout=5m", `namespace "pools" deleted`)
}
