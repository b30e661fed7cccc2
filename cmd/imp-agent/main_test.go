package main

import "testing"

func TestLoopbackOnly(t *testing.T) {
	for _, tc := range []struct {
		addr string
		ok   bool
	}{
		{"0", true},
		{"", true},
		{"127.0.0.1:6060", true},
		{"[::1]:6060", true},
		{"localhost:6060", true},
		{":6060", false},
		{"0.0.0.0:6060", false},
		{"10.0.0.5:6060", false},
		{"node.example:6060", false},
		{"127.0.0.1", false}, // no port
	} {
		if err := loopbackOnly(tc.addr); (err == nil) != tc.ok {
			t.Errorf("loopbackOnly(%q) = %v, want ok %v", tc.addr, err, tc.ok)
		}
	}
}
