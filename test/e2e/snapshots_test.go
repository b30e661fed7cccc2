package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// checkSnapshots snapshots the running VM hello with kubectl imp (docs/snapshots.md), on the
// real node through the chart's operator and agent, and starts hello-copy from the snapshot: it
// runs restored, not booted (its console ticks on from the snapshot's count), with its own
// address and hostname, while hello runs on. Deleting the snapshot and the copy leaves hello.
func checkSnapshots(t *testing.T, sh func(string) (string, error), must func(string, ...string) string,
	eventually func(string, time.Duration, func() error), dir, node string, hello map[string]any) {
	t.Helper()
	must("kubectl imp -n demo snapshot hello snap1 --wait", "impvmsnapshot/snap1 ready on node "+node)
	must("kubectl imp -n demo status hello", "Snapshots:", "snap1", "Ready")
	must("kubectl -n demo get impsnap snap1", "snap1", "hello", "Ready", node)

	data, _ := yaml.Marshal(hello)
	var cp map[string]any
	if err := yaml.Unmarshal(data, &cp); err != nil {
		t.Fatal(err)
	}
	cp["metadata"] = map[string]any{"name": "hello-copy", "namespace": "demo"}
	cp["spec"].(map[string]any)["snapshotRef"] = map[string]any{"name": "snap1"}
	data, _ = yaml.Marshal(cp)
	if err := os.WriteFile(filepath.Join(dir, "hello-copy.yaml"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	must("kubectl -n demo apply -f hello-copy.yaml", "impvm.imp.dev/hello-copy created")
	var ip string
	eventually("hello-copy Running and Ready, restored from snap1", 2*time.Minute, func() error {
		out, err := sh("kubectl -n demo get impvm hello-copy -o jsonpath='{.status.phase} {.status.conditions[?(@.type==\"Ready\")].status} {.status.runtime.restoredFrom} {.status.ip}'")
		f := strings.Fields(out)
		if err != nil || len(f) != 4 || f[0] != "Running" || f[1] != "True" || f[2] != "snap1" {
			return fmt.Errorf("%q %v", out, err)
		}
		ip = f[3]
		return nil
	})
	t.Logf("hello-copy Ready %v after its creation, restored from snap1, at %s", time.Since(began).Round(time.Millisecond), ip)
	helloIP := must("kubectl -n demo get impvm hello -o jsonpath='{.status.ip}'")
	if ip == strings.TrimSpace(helloIP) {
		t.Errorf("the copy has the source's address %s", ip)
	}
	must("kubectl imp -n demo exec hello-copy -- /bin/hello tool-read /proc/sys/kernel/hostname", "hello-copy")
	must("kubectl imp -n demo exec hello -- /bin/hello tool-read /proc/sys/kernel/hostname", "hello")
	// Restored, not booted: the copy's console starts at the snapshot's tick, not at 0.
	eventually("hello-copy's console ticking on", time.Minute, func() error {
		out, err := sh("kubectl imp -n demo logs hello-copy")
		ticks := regexp.MustCompile(`hello: tick (\d+)`).FindAllStringSubmatch(out, -1)
		if err != nil || len(ticks) == 0 {
			return fmt.Errorf("%v: %q", err, out)
		}
		if first, _ := strconv.Atoi(ticks[0][1]); first == 0 || strings.Contains(out, "hello from imp") {
			t.Errorf("hello-copy booted anew:\n%s", out)
		}
		return nil
	})
	must("kubectl -n demo delete impvm hello-copy --timeout=2m", `impvm.imp.dev "hello-copy" deleted`)
	must("kubectl -n demo delete impsnap snap1 --timeout=1m", `impvmsnapshot.imp.dev "snap1" deleted`)
	must("kubectl -n demo get impvm hello -o jsonpath='{.status.phase}'", "Running")
}

// checkTemplates makes an ImpVMTemplate of hello's spec (docs/snapshots.md) and two copies of it,
// on the real node through the chart's operator and agent: the template's VM boots once, is
// snapshotted and deleted, and both copies are restored from its snapshot with their own
// hostnames and addresses, reach each other, and keep their disk writes to themselves. Deleting
// the template deletes its snapshot (the cluster's garbage collector).
func checkTemplates(t *testing.T, sh func(string) (string, error), must func(string, ...string) string,
	eventually func(string, time.Duration, func() error), dir string, hello map[string]any) {
	t.Helper()
	spec, write := specAndWriter(t, dir, hello)
	write("web.yaml", map[string]any{"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMTemplate",
		"metadata": map[string]any{"name": "web", "namespace": "demo"}, "spec": map[string]any{"vm": spec}})
	for _, name := range []string{"web-1", "web-2"} {
		write(name+".yaml", map[string]any{"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
			"metadata": map[string]any{"name": name, "namespace": "demo"},
			"spec": map[string]any{"templateRef": map[string]any{"name": "web"}, "networkRef": spec["networkRef"],
				"nodeSelector": spec["nodeSelector"], "stdin": spec["stdin"], "tty": spec["tty"]}})
	}
	began := time.Now()
	must("kubectl -n demo apply -f web.yaml -f web-1.yaml -f web-2.yaml", "impvmtemplate.imp.dev/web created", "impvm.imp.dev/web-1 created", "impvm.imp.dev/web-2 created")
	ips := map[string]string{}
	from := ""
	for _, name := range []string{"web-1", "web-2"} {
		eventually(name+" Running and Ready, restored from the template's snapshot", 4*time.Minute, func() error {
			out, err := sh("kubectl -n demo get impvm " + name + " -o jsonpath='{.status.phase} {.status.conditions[?(@.type==\"Ready\")].status} {.status.runtime.restoredFrom} {.status.ip}'")
			f := strings.Fields(out)
			if err != nil || len(f) != 4 || f[0] != "Running" || f[1] != "True" || !strings.HasPrefix(f[2], "web-") {
				tmpl, _ := sh("kubectl -n demo get impvmt web -o jsonpath='{.status.snapshots}'")
				return fmt.Errorf("%q %v (template: %s)", out, err, tmpl)
			}
			if from != "" && f[2] != from {
				t.Errorf("the copies restored %s and %s", from, f[2])
			}
			from, ips[name] = f[2], f[3]
			return nil
		})
	}
	t.Logf("two copies of a template Ready %v after they were created (its VM booted and snapshotted first)", time.Since(began).Round(time.Millisecond))
	must("kubectl -n demo get impvmt web", "web", "True")
	eventually("the template's VM deleted once snapshotted", time.Minute, func() error {
		if out, err := sh("kubectl -n demo get impvm " + from + " -o name 2>&1 || true"); !strings.Contains(out, "NotFound") {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	})
	for name, other := range map[string]string{"web-1": "web-2", "web-2": "web-1"} {
		must("kubectl imp -n demo exec "+name+" -- /bin/hello tool-read /proc/sys/kernel/hostname", name)
		must("kubectl imp -n demo exec "+name+" -- /bin/hello tool-dial "+ips[other]+":7000", "hello from")
	}
	must("kubectl imp -n demo exec web-1 -- /bin/hello tool-touch /written-by-web-1")
	must("kubectl imp -n demo exec web-1 -- /bin/hello tool-read /written-by-web-1")
	must("kubectl imp -n demo exec web-2 -- /bin/hello tool-absent /written-by-web-1")
	must("kubectl -n demo delete impvm web-1 web-2 --timeout=2m", `impvm.imp.dev "web-1" deleted`, `impvm.imp.dev "web-2" deleted`)
	must("kubectl -n demo delete impvmt web", `impvmtemplate.imp.dev "web" deleted`)
	eventually("the template's snapshot deleted with it", 2*time.Minute, func() error {
		out, err := sh("kubectl -n demo get impsnap -l imp.dev/template=web -o name")
		if err != nil || strings.TrimSpace(out) != "" {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	})
}

// specAndWriter is a copy of hello's spec, for templates, and what writes a manifest into dir.
func specAndWriter(t *testing.T, dir string, hello map[string]any) (map[string]any, func(name string, obj map[string]any)) {
	data, _ := yaml.Marshal(hello["spec"])
	var spec map[string]any
	if err := yaml.Unmarshal(data, &spec); err != nil {
		t.Fatal(err)
	}
	return spec, func(name string, obj map[string]any) {
		data, _ := yaml.Marshal(obj)
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
