package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// checkVolumes gives VMs PersistentVolumeClaims on the real node (docs/volumes.md): static local
// volumes, one of volumeMode Filesystem (a directory of the node) and one of volumeMode Block (a
// loop device), of a WaitForFirstConsumer class, attached by the kubelet to each VM's holder
// pod and handed to the VMM by the chart's agent. What the VM writes on both is there after a
// restart, after its agent is killed with SIGKILL, and after the VM is deleted and made again
// with the same claims; a second VM naming a claim waits VolumeInUse until the first is gone,
// then sees the data. Then a claim of local-path-provisioner's class (below).
func checkVolumes(t *testing.T, sh func(string) (string, error), must func(string, ...string) string,
	eventually func(string, time.Duration, func() error), dir, node, image string) {
	t.Helper()
	fsDir := filepath.Join(nodeState, "pv", "fs")
	if err := os.MkdirAll(fsDir, 0o755); err != nil {
		t.Fatal(err)
	}
	backing := filepath.Join(nodeState, "pv", "block.img")
	if err := os.WriteFile(backing, nil, 0o600); err != nil || os.Truncate(backing, 256<<20) != nil {
		t.Fatalf("making the block volume's file: %v", err)
	}
	out, err := exec.Command("losetup", "--find", "--show", backing).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	loop := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		// The kubelet binds a loop device of its own over a block volume's device while a pod
		// maps it, and one killed with the test never lets go: those first, or the device stays.
		out, _ := exec.Command("losetup", "-j", loop).Output()
		for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			if dev, _, ok := strings.Cut(l, ":"); ok {
				_ = exec.Command("losetup", "-d", dev).Run()
			}
		}
		_ = exec.Command("losetup", "-d", loop).Run()
	})

	objects := fmt.Sprintf(`apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: local}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: v1
kind: PersistentVolume
metadata: {name: e2e-fs}
spec:
  capacity: {storage: 512Mi}
  accessModes: [ReadWriteOnce]
  storageClassName: local
  persistentVolumeReclaimPolicy: Retain
  local: {path: %[1]s}
  nodeAffinity:
    required:
      nodeSelectorTerms: [{matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [%[3]s]}]}]
---
apiVersion: v1
kind: PersistentVolume
metadata: {name: e2e-block}
spec:
  capacity: {storage: 256Mi}
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: local
  persistentVolumeReclaimPolicy: Retain
  local: {path: %[2]s}
  nodeAffinity:
    required:
      nodeSelectorTerms: [{matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [%[3]s]}]}]
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data-fs, namespace: demo}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: local
  resources: {requests: {storage: 256Mi}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data-block, namespace: demo}
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: local
  resources: {requests: {storage: 256Mi}}
`, fsDir, loop, node)
	if err := os.WriteFile(filepath.Join(dir, "volumes.yaml"), []byte(objects), 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl apply -f volumes.yaml", "persistentvolume/e2e-fs created", "persistentvolume/e2e-block created", "persistentvolumeclaim/data-fs created")
	vmYAML := func(name string) string {
		return fmt.Sprintf(`apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata: {name: %s, namespace: demo}
spec:
  image: %s
  command: [/bin/hello]
  args: [serve]
  resources: {vcpus: 1, memory: 192Mi}
  nodeSelector: {imp.test/node: %s}
  terminationGracePeriodSeconds: 2
  volumes:
  - {name: fs, persistentVolumeClaim: {claimName: data-fs}}
  - {name: block, persistentVolumeClaim: {claimName: data-block}}
  volumeMounts:
  - {name: fs, mountPath: /data}
  - {name: block, mountPath: /blk}
`, name, image, node)
	}
	apply := func(name string) {
		if err := os.WriteFile(filepath.Join(dir, name+".yaml"), []byte(vmYAML(name)), 0o644); err != nil {
			t.Fatal(err)
		}
		must("kubectl apply -f "+name+".yaml", "impvm.imp.dev/"+name+" created")
	}
	ready := func(name string, restarts int) {
		t.Helper()
		eventually(name+" Running and Ready", 4*time.Minute, func() error {
			out, err := sh("kubectl -n demo get impvm " + name + " -o jsonpath='{.status.phase} {.status.conditions[?(@.type==\"Ready\")].status} {.status.restartCount} {.status.runtime.run}'")
			f := append(strings.Fields(out), "0", "0") // restartCount and run are left out at 0
			want := fmt.Sprint(restarts)
			if err != nil || len(f) < 4 || f[0] != "Running" || f[1] != "True" || f[2] != want || f[3] != want {
				st, _ := sh("kubectl -n demo get impvm " + name + " -o jsonpath='{.status.conditions} {.status.runtime.message} {.status.volumeHolder.message}'")
				return fmt.Errorf("%q %v; %s", out, err, st)
			}
			// The new run's session answers.
			_, err = sh("kubectl imp -n demo exec " + name + " -- /bin/hello tool-true")
			return err
		})
	}
	data := func(name, want string) {
		t.Helper()
		must("kubectl imp -n demo exec "+name+" -- /bin/hello tool-read /data/f", want)
		must("kubectl imp -n demo exec "+name+" -- /bin/hello tool-read /blk/f", want)
	}

	began := time.Now()
	apply("vol-a")
	ready("vol-a", 0)
	t.Logf("vol-a Ready %v after its creation (a holder pod, two claims)", time.Since(began).Round(time.Millisecond))
	must("kubectl -n demo get pods -l imp.dev/volume-holder=true -o wide", "imp-vol-", "Running", node)
	must("kubectl -n demo get pvc data-fs data-block", "Bound")
	must("kubectl imp -n demo exec vol-a -- /bin/hello tool-write /data/f written-by-vol-a")
	must("kubectl imp -n demo exec vol-a -- /bin/hello tool-write /blk/f written-by-vol-a")
	// The Filesystem claim holds the disk image, on the node's directory.
	if fi, err := os.Stat(filepath.Join(fsDir, "disk.img")); err != nil || fi.Size() != 256<<20 {
		t.Errorf("the claim's disk image: %v %v", fi, err)
	}

	// Restarted: the same disks.
	must("kubectl -n demo annotate impvm vol-a imp.dev/restart-requested-at="+time.Now().Format(time.RFC3339Nano)+" --overwrite", "annotated")
	ready("vol-a", 1)
	data("vol-a", "written-by-vol-a")

	// The agent killed: the VM runs on, its disks with it.
	must("pkill -KILL -x imp-agent")
	time.Sleep(2 * time.Second)
	ready("vol-a", 1)
	data("vol-a", "written-by-vol-a")

	// A second VM naming the claims waits for them.
	apply("vol-b")
	eventually("vol-b waits VolumeInUse", time.Minute, func() error {
		out, err := sh("kubectl -n demo get impvm vol-b -o jsonpath='{.status.conditions[?(@.type==\"Scheduled\")].reason}: {.status.conditions[?(@.type==\"Scheduled\")].message}'")
		if err != nil || !strings.Contains(out, "VolumeInUse") || !strings.Contains(out, "attached to VM vol-a") {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	})
	// The first deleted: the second runs, on the first's data.
	must("kubectl -n demo delete impvm vol-a --timeout=2m", `impvm.imp.dev "vol-a" deleted`)
	ready("vol-b", 0)
	data("vol-b", "written-by-vol-a")
	must("kubectl imp -n demo exec vol-b -- /bin/hello tool-write /data/f written-by-vol-b")
	must("kubectl imp -n demo exec vol-b -- /bin/hello tool-write /blk/f written-by-vol-b")

	// Deleted and made again with the same claims: the data is there.
	must("kubectl -n demo delete impvm vol-b --timeout=2m", `impvm.imp.dev "vol-b" deleted`)
	eventually("vol-b's holder pod gone", time.Minute, func() error {
		out, err := sh("kubectl -n demo get pods -l imp.dev/volume-holder=true -o name")
		if err != nil || strings.TrimSpace(out) != "" {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	})
	apply("vol-b")
	ready("vol-b", 0)
	data("vol-b", "written-by-vol-b")
	must("kubectl -n demo delete impvm vol-b --timeout=2m", `impvm.imp.dev "vol-b" deleted`)

	// A claim the VM takes read-only, mounted without readOnly: the disk is write-protected,
	// imp-init mounts it read-only (as mount(8) does), the data reads, a write fails.
	ro := fmt.Sprintf(`apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata: {name: vol-ro, namespace: demo}
spec:
  image: %s
  command: [/bin/hello]
  args: [serve]
  resources: {vcpus: 1, memory: 192Mi}
  nodeSelector: {imp.test/node: %s}
  terminationGracePeriodSeconds: 2
  volumes: [{name: fs, persistentVolumeClaim: {claimName: data-fs, readOnly: true}}]
  volumeMounts: [{name: fs, mountPath: /data}]
`, image, node)
	if err := os.WriteFile(filepath.Join(dir, "vol-ro.yaml"), []byte(ro), 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl apply -f vol-ro.yaml", "impvm.imp.dev/vol-ro created")
	ready("vol-ro", 0)
	must("kubectl imp -n demo exec vol-ro -- /bin/hello tool-read /data/f", "written-by-vol-b")
	if out, err := sh("kubectl imp -n demo exec vol-ro -- /bin/hello tool-write /data/f overwritten"); err == nil {
		t.Errorf("a write to a read-only claim succeeded: %s", out)
	}
	must("kubectl -n demo delete impvm vol-ro --timeout=2m", `impvm.imp.dev "vol-ro" deleted`)
	must("kubectl delete -f volumes.yaml --timeout=2m", "deleted")

	// ### Dynamic provisioning: rancher's local-path-provisioner (hack/real-node.sh), as kind and
	// k3s have it. A WaitForFirstConsumer claim is provisioned where the holder pod is scheduled,
	// on this node, and its volume carries that node's affinity; the data outlives the VM; a
	// claim deleted takes its directory with it. The figure: what a claim adds to a VM's start
	// beyond its holder pod's own start, against a VM without volumes made just before.
	clock := watchReady(t, filepath.Join(dir, "cp", "kubeconfig"), "demo")
	plainVM := fmt.Sprintf(`apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata: {name: vol-plain, namespace: demo}
spec:
  image: %s
  command: [/bin/hello]
  args: [serve]
  resources: {vcpus: 1, memory: 192Mi}
  nodeSelector: {imp.test/node: %s}
  terminationGracePeriodSeconds: 2
`, image, node)
	dynamic := fmt.Sprintf(`apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data-dyn, namespace: demo}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: local-path
  resources: {requests: {storage: 128Mi}}
---
apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata: {name: vol-dyn, namespace: demo}
spec:
  image: %s
  command: [/bin/hello]
  args: [serve]
  resources: {vcpus: 1, memory: 192Mi}
  nodeSelector: {imp.test/node: %s}
  terminationGracePeriodSeconds: 2
  volumes: [{name: data, persistentVolumeClaim: {claimName: data-dyn}}]
  volumeMounts: [{name: data, mountPath: /data}]
`, image, node)
	for f, y := range map[string]string{"vol-plain.yaml": plainVM, "vol-dyn.yaml": dynamic} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte(y), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	since := func(key string, from time.Time) time.Duration {
		t.Helper()
		at, ok := clock.ready(key)
		if !ok {
			t.Fatalf("%s: no Ready seen", key)
		}
		return at.Sub(from)
	}
	t0 := time.Now()
	must("kubectl apply -f vol-plain.yaml", "impvm.imp.dev/vol-plain created")
	ready("vol-plain", 0)
	plain := since("impvm/vol-plain", t0)
	must("kubectl -n demo delete impvm vol-plain --timeout=2m", `impvm.imp.dev "vol-plain" deleted`)

	t0 = time.Now()
	must("kubectl apply -f vol-dyn.yaml", "persistentvolumeclaim/data-dyn created", "impvm.imp.dev/vol-dyn created")
	ready("vol-dyn", 0)
	holder, vm := since("holder/vol-dyn", t0), since("impvm/vol-dyn", t0)
	t.Logf("BENCH volume start: a VM without volumes Ready %v after its creation; with a dynamically provisioned claim its holder pod Ready after %v and the VM %v after that: the claim adds %v beyond the holder pod's start (target ≤ 1s)",
		plain.Round(time.Millisecond), holder.Round(time.Millisecond), (vm - holder).Round(time.Millisecond), (vm - holder - plain).Round(time.Millisecond))
	pv := strings.TrimSpace(must("kubectl -n demo get pvc data-dyn -o jsonpath='{.spec.volumeName}'"))
	must("kubectl get pv "+pv+" -o jsonpath='{.spec.storageClassName} {.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[0].values[0]} {.spec.hostPath.path}'",
		"local-path "+node+" "+filepath.Join(nodeState, "local-path", "volumes"))
	hostDir := strings.TrimSpace(must("kubectl get pv " + pv + " -o jsonpath='{.spec.hostPath.path}'"))
	if fi, err := os.Stat(filepath.Join(hostDir, "disk.img")); err != nil || fi.Size() != 128<<20 {
		t.Errorf("the dynamic claim's disk image: %v %v", fi, err)
	}
	must("kubectl imp -n demo exec vol-dyn -- /bin/hello tool-write /data/f written-on-a-dynamic-claim")
	must("kubectl -n demo delete impvm vol-dyn --timeout=2m", `impvm.imp.dev "vol-dyn" deleted`)
	must("kubectl apply -f vol-dyn.yaml", "impvm.imp.dev/vol-dyn created")
	ready("vol-dyn", 0)
	must("kubectl imp -n demo exec vol-dyn -- /bin/hello tool-read /data/f", "written-on-a-dynamic-claim")
	must("kubectl -n demo delete impvm vol-dyn --timeout=2m", `impvm.imp.dev "vol-dyn" deleted`)
	// The claim deleted once its holder pod is gone: the provisioner's helper removes the directory.
	must("kubectl -n demo delete pvc data-dyn --timeout=2m", `persistentvolumeclaim "data-dyn" deleted`)
	eventually("the dynamic volume and its directory gone", 2*time.Minute, func() error {
		out, err := sh("kubectl get pv " + pv + " -o name")
		if _, serr := os.Stat(hostDir); !os.IsNotExist(serr) || err == nil || !strings.Contains(out, "NotFound") {
			return fmt.Errorf("pv %q %v, directory %v", out, err, serr)
		}
		return nil
	})
}
