package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// checkWarmPools makes an ImpWarmPool of 3 members of a template of hello's spec
// (docs/warmpools.md), on the real node through the chart's operator and agent, and four
// claims at once: three are handed the members' running guests (status.start warm, each its
// own host name), the fourth is restored from the template; the pool is back to 3 idle
// members; `kubectl scale` grows it to 5 and empties it.
func checkWarmPools(t *testing.T, sh func(string) (string, error), must func(string, ...string) string,
	eventually func(string, time.Duration, func() error), dir string, hello map[string]any) {
	t.Helper()
	spec, write := specAndWriter(t, dir, hello)
	write("wp.yaml", map[string]any{"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMTemplate",
		"metadata": map[string]any{"name": "wp", "namespace": "demo"}, "spec": map[string]any{"vm": spec}})
	write("pool.yaml", map[string]any{"apiVersion": "imp.dev/v1alpha1", "kind": "ImpWarmPool",
		"metadata": map[string]any{"name": "p", "namespace": "demo"},
		"spec": map[string]any{"templateRef": map[string]any{"name": "wp"}, "replicas": 3,
			"networkRef": spec["networkRef"], "nodeSelector": spec["nodeSelector"]}})
	idle := func(want string, within time.Duration) {
		eventually("impwarmpool/p with "+want+" idle members", within, func() error {
			// status.idle is omitted while it is 0.
			out, err := sh("kubectl -n demo get impwp p -o jsonpath='idle={.status.idle}; replicas={.status.replicas}'")
			if err != nil || !strings.HasPrefix(strings.TrimSpace(out), "idle="+want+";") {
				return fmt.Errorf("%q %v", out, err)
			}
			return nil
		})
	}
	began := time.Now()
	must("kubectl -n demo apply -f wp.yaml -f pool.yaml", "impvmtemplate.imp.dev/wp created", "impwarmpool.imp.dev/p created")
	idle("3", 6*time.Minute)
	t.Logf("a warm pool of 3 idle members %v after it was created (its template's VM booted and snapshotted first)", time.Since(began).Round(time.Millisecond))
	must("kubectl -n demo get impwp p", "p", "3")

	claims := []string{"claim-1", "claim-2", "claim-3", "claim-4"}
	var files []string
	for _, name := range claims {
		write(name+".yaml", map[string]any{"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
			"metadata": map[string]any{"name": name, "namespace": "demo"},
			"spec":     map[string]any{"warmPoolRef": map[string]any{"name": "p"}, "networkRef": spec["networkRef"], "nodeSelector": spec["nodeSelector"]}})
		files = append(files, "-f "+name+".yaml")
	}
	began = time.Now()
	must("kubectl -n demo apply "+strings.Join(files, " "), "impvm.imp.dev/claim-1 created", "impvm.imp.dev/claim-4 created")
	starts := map[string]int{}
	for _, name := range claims {
		eventually(name+" Running and Ready", 4*time.Minute, func() error {
			out, err := sh("kubectl -n demo get impvm " + name + " -o jsonpath='{.status.phase} {.status.conditions[?(@.type==\"Ready\")].status} {.status.start}'")
			f := strings.Fields(out)
			if err != nil || len(f) != 3 || f[0] != "Running" || f[1] != "True" {
				return fmt.Errorf("%q %v", out, err)
			}
			starts[f[2]]++
			return nil
		})
	}
	t.Logf("four claims Ready %v after they were created: %v", time.Since(began).Round(time.Millisecond), starts)
	if starts["warm"] != 3 || starts["restored"] != 1 {
		t.Errorf("claims by how they started: %v; want 3 warm and 1 restored", starts)
		// Why a handover failed (the step and its error), and what the node's agent said.
		_, _ = sh("kubectl -n demo get events --field-selector reason=WarmHandoverFailed -o custom-columns=OBJ:.involvedObject.name,FROM:.source.component,NOTE:.message")
		_, _ = sh(`kubectl -n imp-system logs -l app.kubernetes.io/name=imp-runtime --tail=-1 | grep -E 'claim-|handover' | tail -40`)
	}
	for _, name := range claims {
		must("kubectl imp -n demo exec "+name+" -- /bin/hello tool-read /proc/sys/kernel/hostname", name)
	}
	must("kubectl -n demo get impvm -o wide", "START", "warm", "restored")
	idle("3", 4*time.Minute)
	// Room on the node for 5 members (its vCPUs, overcommitted 4 times): three claims go.
	must("kubectl -n demo delete impvm claim-2 claim-3 claim-4 --timeout=2m", `impvm.imp.dev "claim-2" deleted`)

	must("kubectl -n demo scale impwarmpool/p --replicas 5", "impwarmpool.imp.dev/p scaled")
	idle("5", 4*time.Minute)
	must("kubectl -n demo scale impwarmpool/p --replicas 0", "impwarmpool.imp.dev/p scaled")
	eventually("impwarmpool/p emptied", 3*time.Minute, func() error {
		out, err := sh("kubectl -n demo get impvm -l imp.dev/warm-pool=p -o name")
		if err != nil || strings.TrimSpace(out) != "" {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	})
	// The claims are the claimants': deleting the pool leaves them running.
	must("kubectl -n demo delete impwp p", `impwarmpool.imp.dev "p" deleted`)
	must("kubectl imp -n demo exec claim-1 -- /bin/hello tool-read /proc/sys/kernel/hostname", "claim-1")
	must("kubectl -n demo delete impvm claim-1 --timeout=2m", `impvm.imp.dev "claim-1" deleted`)
	must("kubectl -n demo delete impvmt wp", `impvmtemplate.imp.dev "wp" deleted`)
}
