// Package kubectlimptest runs `kubectl imp` in tests, in-process, against a test's cluster.
package kubectlimptest

import (
	"bytes"
	"strings"
	"testing"

	"github.com/syscode-labs/imp/internal/kubectlimp"
)

// Run runs `kubectl imp ARGS...` with kubeconfig in namespace ns and returns what it printed
// (logged too); a failure fails the test with what it printed.
func Run(t testing.TB, kubeconfig, ns string, args ...string) string {
	t.Helper()
	var out, errOut bytes.Buffer
	cmd := kubectlimp.NewCommand(strings.NewReader(""), &out, &errOut)
	cmd.SetArgs(append([]string{"--kubeconfig", kubeconfig, "-n", ns}, args...))
	if err := cmd.Execute(); err != nil {
		t.Fatalf("kubectl imp %v: %v\n%s%s", args, err, out.String(), errOut.String())
	}
	t.Logf("kubectl imp %v:\n%s", args, out.String())
	return out.String()
}
