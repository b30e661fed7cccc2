package subresources

import (
	"crypto/tls"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"
)

// A node's transport is reused while requests take it, and dropped once unused for longer than
// an idle connection lives, so that nodes come and gone leave nothing behind.
func TestTransportsOfIdleNodesAreDropped(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC))
	s := &Server{AgentTLS: &tls.Config{MinVersion: tls.VersionTLS13}, Clock: clk}
	a, b := s.transport("a"), s.transport("b")
	if a == b {
		t.Fatal("two nodes share a transport")
	}
	if got := a.TLSClientConfig.ServerName; got == b.TLSClientConfig.ServerName {
		t.Fatalf("two nodes' transports expect the same server name %q", got)
	}
	clk.SetTime(clk.Now().Add(agentIdleTimeout * 2 / 3))
	if s.transport("a") != a {
		t.Fatal("a node's transport was not reused")
	}
	clk.SetTime(clk.Now().Add(agentIdleTimeout * 2 / 3)) // b unused for 4/3 of the timeout, a for 2/3
	s.transport("c")
	if got := s.transports(); got != 2 {
		t.Fatalf("%d transports kept, want 2 (a, used lately, and c)", got)
	}
	if s.transport("a") != a {
		t.Fatal("a transport in use was dropped")
	}
	if s.transport("b") == b {
		t.Fatal("an idle node's transport was kept")
	}
}
