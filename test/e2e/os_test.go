package e2e

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// checkOS (docs/os.md): a Debian VM of boot OS (hack/os-image.sh's image, pushed to the test's
// registry) on the real node, with an SSH key from a Secret for root and a Service on port
// 22: systemd says the system is running through kubectl imp exec, and a real ssh client logs
// in with the key through the Service's ClusterIP (the node's kube-proxy) and through kubectl
// imp port-forward. (cloud-init's user data and a key's rotation are agent.TestAnOSBootsItsInit's.)
func checkOS(t *testing.T, sh func(string) (string, error), must func(string, ...string) string,
	eventually func(string, time.Duration, func() error), env []string, dir, root, registry, node string) {
	t.Helper()
	build := exec.Command("hack/os-image.sh", registry+"/debian:bookworm")
	build.Dir = root
	out, err := build.Output()
	if err != nil {
		t.Fatalf("hack/os-image.sh: %v", err)
	}
	f := strings.Fields(string(out))
	if len(f) == 0 {
		t.Fatal("hack/os-image.sh printed no image")
	}
	image := f[len(f)-1]
	key := filepath.Join(dir, "os-key")
	if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "e2e", "-f", key).CombinedOutput(); err != nil {
		t.Fatalf("ssh-keygen: %v: %s", err, out)
	}
	objs := fmt.Sprintf(`apiVersion: imp.dev/v1alpha1
kind: ImpNetwork
metadata: {name: os, namespace: os}
spec: {cidr: 10.103.0.0/24}
---
apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata: {name: debian, namespace: os, labels: {app: debian}}
spec:
  image: %s
  boot: OS
  resources: {vcpus: 1, memory: 512Mi}
  diskSize: 256Mi
  nodeSelector: {imp.test/node: %s}
  networkRef: {name: os}
  ports: [{name: ssh, port: 22}]
  accessCredentials:
    - sshPublicKeys: {secretName: keys}
      users: [root]
---
apiVersion: v1
kind: Service
metadata: {name: ssh, namespace: os}
spec:
  selector: {app: debian}
  ports: [{name: ssh, port: 22, targetPort: ssh}]
`, image, node)
	if err := os.WriteFile(filepath.Join(dir, "os.yaml"), []byte(objs), 0o644); err != nil {
		t.Fatal(err)
	}
	must("kubectl create namespace os")
	must("kubectl -n os create secret generic keys --from-file=root="+key+".pub", "created")
	began := time.Now()
	must("kubectl apply -f os.yaml", "impvm.imp.dev/debian created")
	eventually("the Debian VM Ready", 10*time.Minute, func() error {
		out, err := sh(`kubectl -n os get impvm debian -o jsonpath='{.status.phase} {.status.conditions[?(@.type=="Ready")].status}'`)
		if err != nil || strings.TrimSpace(out) != "Running True" {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	})
	t.Logf("the Debian VM Ready %v after its creation", time.Since(began).Round(time.Millisecond))
	must("kubectl imp -n os exec debian -- systemctl is-system-running", "running")
	must("kubectl imp -n os exec debian -- cat /proc/1/comm", "systemd")

	ssh := func(port, host string) (string, error) {
		return sh(fmt.Sprintf("timeout 120 ssh -F /dev/null -i %s -p %s -o BatchMode=yes -o IdentitiesOnly=yes -o StrictHostKeyChecking=no "+
			"-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=60 root@%s cat /etc/hostname", key, port, host))
	}
	ip := strings.Trim(must("kubectl -n os get svc ssh -o jsonpath='{.spec.clusterIP}'"), "' \n")
	eventually("ssh as root with the Secret's key, through Service ssh", 3*time.Minute, func() error {
		if out, err := ssh("22", ip); err != nil || strings.TrimSpace(out) != "debian" {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	})
	must("kubectl -n os get events --field-selector involvedObject.name=debian,reason=AccessCredentialsGiven", "AccessCredentialsGiven")

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	fwd := exec.Command("kubectl", "imp", "-n", "os", "port-forward", "debian", fmt.Sprintf("%d:22", port))
	fwd.Env, fwd.Dir = env, dir
	if err := fwd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = fwd.Process.Kill(); _ = fwd.Wait() }()
	eventually("ssh as root through kubectl imp port-forward", 3*time.Minute, func() error {
		if out, err := ssh(fmt.Sprint(port), "127.0.0.1"); err != nil || strings.TrimSpace(out) != "debian" {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	})
	_ = fwd.Process.Kill()
	must("kubectl delete namespace os --timeout=5m")
}
