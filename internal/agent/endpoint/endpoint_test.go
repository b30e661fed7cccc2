package endpoint

import (
	"context"
	"net/netip"
	"testing"
)

func TestAssign(t *testing.T) {
	ctx := context.Background()
	block := netip.MustParsePrefix("100.72.3.0/29") // hosts .1 to .6
	a := &Allocator{
		Block: func(context.Context) (netip.Prefix, error) { return block, nil },
		Recorded: func() (map[netip.Addr]string, error) {
			return map[netip.Addr]string{netip.MustParseAddr("100.72.3.2"): "old"}, nil
		},
	}
	got := map[string]string{}
	for _, uid := range []string{"a", "b", "old"} {
		c, err := a.Assign(ctx, uid, netip.Addr{})
		if err != nil {
			t.Fatal(err)
		}
		got[uid] = c.String()
	}
	if got["a"] != "100.72.3.1" || got["b"] != "100.72.3.3" || got["old"] != "100.72.3.2" {
		t.Fatalf("assigned %v: want the lowest free, the recorded kept", got)
	}
	// A record's address is honoured when free, refused when another VM holds it or it is not
	// of the block.
	if c, _ := a.Assign(ctx, "c", netip.MustParseAddr("100.72.3.5")); c.String() != "100.72.3.5" {
		t.Errorf("c got %s, want its recorded 100.72.3.5", c)
	}
	if c, _ := a.Assign(ctx, "d", netip.MustParseAddr("100.72.3.1")); c.String() == "100.72.3.1" {
		t.Error("d took a's address")
	}
	if c, _ := a.Assign(ctx, "e", netip.MustParseAddr("100.72.4.9")); !block.Contains(c) {
		t.Errorf("e got %s outside the block", c)
	}
	if _, err := a.Assign(ctx, "f", netip.Addr{}); err == nil {
		t.Error("an address past the block's six")
	}
	a.Release("b")
	if c, _ := a.Assign(ctx, "f", netip.Addr{}); c.String() != "100.72.3.3" {
		t.Errorf("f got %s, want b's freed 100.72.3.3", c)
	}
	for _, bad := range []string{"100.72.3.0", "100.72.3.7"} {
		if usable(block, netip.MustParseAddr(bad)) {
			t.Errorf("%s is usable", bad)
		}
	}
}
