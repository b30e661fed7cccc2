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
