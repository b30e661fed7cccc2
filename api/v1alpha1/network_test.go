package v1alpha1

import (
	"fmt"
	"net/netip"
	"testing"
)

func TestGatewayAndCapacity(t *testing.T) {
	tests := []struct {
		name         string
		spec         ImpNetworkSpec
		wantGateway  string
		wantCapacity int64
		wantErr      bool
	}{
		{name: "default gateway is the first host", spec: ImpNetworkSpec{CIDR: "10.100.0.0/24"}, wantGateway: "10.100.0.1", wantCapacity: 253},
		{name: "explicit gateway", spec: ImpNetworkSpec{CIDR: "10.100.0.0/24", Gateway: "10.100.0.254"}, wantGateway: "10.100.0.254", wantCapacity: 253},
		{name: "smallest network holds one VM", spec: ImpNetworkSpec{CIDR: "192.168.7.0/30"}, wantGateway: "192.168.7.1", wantCapacity: 1},
		{name: "largest network", spec: ImpNetworkSpec{CIDR: "10.0.0.0/8"}, wantGateway: "10.0.0.1", wantCapacity: 1<<24 - 3},
		{name: "gateway outside", spec: ImpNetworkSpec{CIDR: "10.100.0.0/24", Gateway: "10.101.0.1"}, wantErr: true},
		{name: "gateway on network address", spec: ImpNetworkSpec{CIDR: "10.100.0.0/24", Gateway: "10.100.0.0"}, wantErr: true},
		{name: "gateway on broadcast", spec: ImpNetworkSpec{CIDR: "10.100.0.0/24", Gateway: "10.100.0.255"}, wantErr: true},
		{name: "host bits set", spec: ImpNetworkSpec{CIDR: "10.100.0.5/24"}, wantErr: true},
		{name: "IPv6", spec: ImpNetworkSpec{CIDR: "fd00::/64"}, wantErr: true},
		{name: "too small", spec: ImpNetworkSpec{CIDR: "10.0.0.0/31"}, wantErr: true},
		{name: "too large", spec: ImpNetworkSpec{CIDR: "10.0.0.0/7"}, wantErr: true},
		{name: "garbage", spec: ImpNetworkSpec{CIDR: "ten/8"}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			gw, err := tt.spec.GatewayAddr()
			if (err != nil) != tt.wantErr {
				t.Fatalf("GatewayAddr error = %v, wantErr %v", err, tt.wantErr)
			}
			if err != nil {
				return
			}
			if gw.String() != tt.wantGateway {
				t.Errorf("gateway = %s, want %s", gw, tt.wantGateway)
			}
			n, err := tt.spec.HostCapacity()
			if err != nil || n != tt.wantCapacity {
				t.Errorf("HostCapacity = %d, %v, want %d", n, err, tt.wantCapacity)
			}
		})
	}
}

func TestBroadcast(t *testing.T) {
	for cidr, want := range map[string]string{
		"10.100.0.0/24":  "10.100.0.255",
		"10.0.0.0/8":     "10.255.255.255",
		"192.168.7.4/30": "192.168.7.7",
	} {
		if got := Broadcast(netip.MustParsePrefix(cidr)); got.String() != want {
			t.Errorf("Broadcast(%s) = %s, want %s", cidr, got, want)
		}
	}
}

func TestReservedOverlap(t *testing.T) {
	reserved := []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12"), netip.MustParsePrefix("192.168.1.0/24")}
	tests := []struct {
		cidr string
		want string // the overlapped range; "" for none
	}{
		{"10.100.0.0/24", "10.96.0.0/12"},    // inside
		{"10.0.0.0/8", "10.96.0.0/12"},       // around
		{"10.112.0.0/24", ""},                // just after
		{"192.168.0.0/16", "192.168.1.0/24"}, // around the second
		{"192.168.2.0/24", ""},
		{"garbage", ""},
	}
	for _, tt := range tests {
		t.Run(tt.cidr, func(t *testing.T) {
			spec := ImpNetworkSpec{CIDR: tt.cidr}
			got, ok := spec.ReservedOverlap(reserved)
			if ok != (tt.want != "") || (ok && got.String() != tt.want) {
				t.Errorf("ReservedOverlap(%s) = %v, %v; want %q", tt.cidr, got, ok, tt.want)
			}
		})
	}
}

func TestParseIPv4CIDRs(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want string
		err  bool
	}{
		{"", "[]", false},
		{"10.96.0.0/12, 10.244.1.7/16,", "[10.96.0.0/12 10.244.0.0/16]", false},
		{"10.0.0.0/8,fd00::/8", "", true},
		{"ten", "", true},
	} {
		got, err := ParseIPv4CIDRs(tt.in)
		if (err != nil) != tt.err || (!tt.err && fmt.Sprint(got) != tt.want) {
			t.Errorf("ParseIPv4CIDRs(%q) = %v, %v; want %s (error %v)", tt.in, got, err, tt.want, tt.err)
		}
	}
}
