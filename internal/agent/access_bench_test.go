package agent_test

import (
	"bytes"
	"context"
	"io"
	"net/url"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/guestsession/guesttest"
	"github.com/syscode-labs/imp/internal/subresources"
	"github.com/syscode-labs/imp/internal/subresources/subresourcestest"
)

// TestBenchAccess is `make bench-access`, skipped otherwise (IMP_BENCH=access): with a QEMU/TCG
// guest already running, the round trip of `exec VM -- true` as kubectl imp makes it (WebSocket,
// through the API server's aggregation layer, the subresource server and the agent), and the
// throughput of a port-forward to the guest's TCP echo server. It prints figures and asserts
// none of them.
func TestBenchAccess(t *testing.T) {
	if os.Getenv("IMP_BENCH") != "access" {
		t.Skip("a benchmark: make bench-access")
	}
	runs, _ := strconv.Atoi(os.Getenv("IMP_BENCH_RUNS"))
	if runs <= 0 {
		runs = 50
	}
	mib, _ := strconv.Atoi(os.Getenv("IMP_BENCH_MIB"))
	if mib <= 0 {
		mib = 100
	}
	w := newWorld(t)
	vm := w.vm("bench", "serve")
	if err := w.c.Client.Create(context.Background(), vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	g.Eventually(func() bool {
		v := w.get("bench")
		return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(9 * time.Minute).Should(BeTrue())
	subresourcestest.Serve(t, w.c, w.node, w.agent.Runs)
	cfg := rest.CopyConfig(w.c.Config)
	base, _, _ := rest.DefaultServerUrlFor(cfg)
	path := func(sub string) *url.URL {
		u := *base
		u.Path = "/apis/" + subresources.Group + "/" + subresources.Version + "/namespaces/" + w.ns + "/impvms/bench/" + sub
		return &u
	}

	// exec -- true
	u := path("exec")
	u.RawQuery = url.Values{"command": {"/bin/hello", "tool-true"}, "stdout": {"true"}, "stderr": {"true"}}.Encode()
	var times []time.Duration
	for i := 0; i < runs+1; i++ {
		start := time.Now()
		ex, err := remotecommand.NewWebSocketExecutor(cfg, "GET", u.String())
		if err != nil {
			t.Fatal(err)
		}
		if err := ex.StreamWithContext(context.Background(), remotecommand.StreamOptions{Stdout: io.Discard, Stderr: io.Discard}); err != nil {
			t.Fatal(err)
		}
		if i > 0 { // the first opens the guest's session channel
			times = append(times, time.Since(start))
		}
	}
	slices.Sort(times)
	pct := func(p float64) time.Duration { return times[int(p*float64(len(times)-1))] }
	t.Logf("exec VM -- true, %d runs through the API server: P50 %v, P90 %v, max %v", len(times),
		pct(0.5).Round(time.Millisecond/10), pct(0.9).Round(time.Millisecond/10), times[len(times)-1].Round(time.Millisecond/10))

	// port-forward: mib MiB each way through the guest's echo server.
	c, _ := guesttest.PortForward(t, cfg, path("portforward"), 7001)
	chunk := bytes.Repeat([]byte{0xa5}, 1<<20)
	start := time.Now()
	go func() {
		for i := 0; i < mib; i++ {
			if _, err := c.Write(chunk); err != nil {
				return
			}
		}
	}()
	n, err := io.CopyN(io.Discard, c, int64(mib)<<20)
	d := time.Since(start)
	if err != nil {
		t.Fatalf("after %d bytes: %v", n, err)
	}
	t.Logf("port-forward of %d MiB each way through the guest's echo server: %v, %.1f MiB/s", mib, d.Round(time.Millisecond), float64(mib)/d.Seconds())
}
