package impnode

import (
	"net/netip"
	"testing"
)

func TestFreeBlock(t *testing.T) {
	rng := netip.MustParsePrefix("100.72.0.0/22")
	used := map[netip.Prefix]bool{}
	var got []string
	for {
		p, err := FreeBlock(rng, 24, used)
		if err != nil {
			if len(got) != 4 {
				t.Fatalf("ran out after %v: %v", got, err)
			}
			break
		}
		used[p] = true
		got = append(got, p.String())
	}
	if want := "[100.72.0.0/24 100.72.1.0/24 100.72.2.0/24 100.72.3.0/24]"; fmtList(got) != want {
		t.Fatalf("blocks %v, want %s", got, want)
	}
	delete(used, netip.MustParsePrefix("100.72.1.0/24"))
	if p, _ := FreeBlock(rng, 24, used); p.String() != "100.72.1.0/24" {
		t.Fatalf("a freed block is not reused: %v", p)
	}
	top := map[netip.Prefix]bool{}
	for _, b := range []string{"255.255.255.0/26", "255.255.255.64/26", "255.255.255.128/26"} {
		top[netip.MustParsePrefix(b)] = true
	}
	if p, err := FreeBlock(netip.MustParsePrefix("255.255.255.0/24"), 26, top); err != nil || p.String() != "255.255.255.192/26" {
		t.Fatalf("the last block of the address space: %v, %v", p, err)
	}
	top[netip.MustParsePrefix("255.255.255.192/26")] = true
	if _, err := FreeBlock(netip.MustParsePrefix("255.255.255.0/24"), 26, top); err == nil {
		t.Fatal("a block past the end of the address space")
	}
	// A block one VM still has an address of (its node gone) is not free.
	if p, _ := FreeBlock(rng, 24, map[netip.Prefix]bool{netip.MustParsePrefix("100.72.0.7/32"): true}); p.String() != "100.72.1.0/24" {
		t.Fatalf("a block with a VM's address in it was given: %v", p)
	}
	// Blocks of another size (the settings changed) are not overlapped.
	if p, err := FreeBlock(rng, 23, map[netip.Prefix]bool{netip.MustParsePrefix("100.72.0.0/24"): true}); err != nil || p.String() != "100.72.2.0/23" {
		t.Fatalf("a /23 beside a /24: %v, %v", p, err)
	}
	if _, err := FreeBlock(rng, 16, used); err == nil {
		t.Fatal("blocks larger than the range")
	}
}

func fmtList(s []string) string {
	out := "["
	for i, x := range s {
		if i > 0 {
			out += " "
		}
		out += x
	}
	return out + "]"
}
