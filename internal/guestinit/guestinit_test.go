package guestinit_test

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/syscode-labs/imp/internal/guestinit"
)

func TestNetParams(t *testing.T) {
	for _, tc := range []struct {
		name string
		net  guestinit.Net
		want string
	}{
		{"address only", guestinit.Net{Address: netip.MustParsePrefix("10.1.0.5/24"), Gateway: netip.MustParseAddr("10.1.0.1"), MTU: 1450, MAC: "0a:58:0a:01:00:05"},
			"imp.net=10.1.0.5/24,10.1.0.1,1450,0a:58:0a:01:00:05"},
		{"with DNS", guestinit.Net{Address: netip.MustParsePrefix("10.2.3.4/16"), Gateway: netip.MustParseAddr("10.2.0.1"), MTU: 1500, MAC: "0a:58:0a:02:03:04",
			Nameservers: []string{"1.1.1.1", "9.9.9.9"}, Searches: []string{"svc.example", "example"}},
			"imp.net=10.2.3.4/16,10.2.0.1,1500,0a:58:0a:02:03:04 imp.dns=1.1.1.1,9.9.9.9;svc.example,example"},
		{"search only", guestinit.Net{Address: netip.MustParsePrefix("10.2.3.4/16"), Gateway: netip.MustParseAddr("10.2.0.1"), MTU: 1500, MAC: "m", Searches: []string{"a"}},
			"imp.net=10.2.3.4/16,10.2.0.1,1500,m imp.dns=;a"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.net.Params()
			if got := strings.Join(p, " "); got != tc.want {
				t.Fatalf("Params = %q, want %q", got, tc.want)
			}
			back, err := guestinit.ParseNet(append([]string{"console=ttyS0"}, p...))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(*back, tc.net) {
				t.Errorf("ParseNet(Params) = %+v, want %+v", *back, tc.net)
			}
		})
	}
}

func TestParseNetRefusesBadInput(t *testing.T) {
	for _, p := range []string{"imp.net=10.0.0.5,10.0.0.1,1450,m", "imp.net=10.0.0.5/24,10.0.0.1,1450", "imp.net=10.0.0.5/24,gw,1450,m", "imp.net=10.0.0.5/24,10.0.0.1,big,m"} {
		if _, err := guestinit.ParseNet([]string{p}); err == nil {
			t.Errorf("ParseNet(%q) accepted it", p)
		}
	}
	if n, err := guestinit.ParseNet([]string{"console=ttyS0"}); n != nil || err != nil {
		t.Errorf("ParseNet without imp.net = %v, %v", n, err)
	}
}

// TestParseStats reads /proc/meminfo's and /proc/stat's text as a guest's kernel writes them,
// and refuses what lacks the fields.
func TestParseStats(t *testing.T) {
	total, avail, err := guestinit.ParseMeminfo("MemTotal:         197004 kB\nMemFree:          150000 kB\nMemAvailable:     160512 kB\nBuffers: 0 kB\n")
	if err != nil || total != 197004<<10 || avail != 160512<<10 {
		t.Errorf("meminfo: %d %d %v", total, avail, err)
	}
	if _, _, err := guestinit.ParseMeminfo("MemTotal: 1 kB\n"); err == nil {
		t.Error("meminfo without MemAvailable was read")
	}
	// user nice system idle iowait irq softirq steal guest guest_nice
	busy, err := guestinit.ParseCPU("cpu  100 20 30 5000 40 5 6 7 99 99\ncpu0 1 2 3 4 5 6 7 8 9 10\n", 100)
	if err != nil || busy != (100+20+30+5+6+7)*10 {
		t.Errorf("cpu: %d %v", busy, err)
	}
	for _, bad := range []string{"", "cpu0 1 2 3 4 5\n", "cpu  1 x 3 4 5\n"} {
		if _, err := guestinit.ParseCPU(bad, 100); err == nil {
			t.Errorf("cpu line %q was read", bad)
		}
	}
}
