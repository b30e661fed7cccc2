package main

import (
	"encoding/binary"
	"fmt"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// serviceNATTable holds the local node's stand-in for kube-proxy: the one Service the
// end-to-end tests' pods use, the API server's ClusterIP, translated to where the API server
// listens. Nothing else of the host's rule set is touched; "down" deletes the table.
var serviceNATTable = &nftables.Table{Family: nftables.TableFamilyIPv4, Name: "imp-node-service"}

// serviceNAT adds (up) or removes (down) the table. up: VIP:PORT (the kubernetes Service),
// POD_BRIDGE (the pods' bridge), POD_DEST (addr:port pods reach) and LOCAL_DEST (addr:port the
// host's own processes, hostNetwork pods included, reach).
func serviceNAT(args []string) error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	if len(args) == 1 && args[0] == "down" {
		tables, err := c.ListTablesOfFamily(nftables.TableFamilyIPv4)
		if err != nil {
			return err
		}
		for _, t := range tables {
			if t.Name == serviceNATTable.Name {
				c.DelTable(serviceNATTable)
				return c.Flush()
			}
		}
		return nil
	}
	if len(args) != 5 || args[0] != "up" {
		return fmt.Errorf("usage: devtool service-nat up VIP:PORT POD_BRIDGE POD_DEST LOCAL_DEST | devtool service-nat down")
	}
	var aps [3]netip.AddrPort
	for i, s := range []string{args[1], args[3], args[4]} {
		if aps[i], err = netip.ParseAddrPort(s); err != nil || !aps[i].Addr().Is4() {
			return fmt.Errorf("%q is not an IPv4 address:port", s)
		}
	}
	vip, pods, local := aps[0], aps[1], aps[2]
	c.AddTable(serviceNATTable)
	rule := func(name string, hook *nftables.ChainHook, iif string, to netip.AddrPort) {
		ch := c.AddChain(&nftables.Chain{Name: name, Table: serviceNATTable, Type: nftables.ChainTypeNAT,
			Hooknum: hook, Priority: nftables.ChainPriorityNATDest})
		var ex []expr.Any
		if iif != "" {
			name := make([]byte, unix.IFNAMSIZ)
			copy(name, iif)
			ex = append(ex, &expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: name})
		}
		a, p := vip.Addr().As4(), make([]byte, 2)
		binary.BigEndian.PutUint16(p, vip.Port())
		ta, tp := to.Addr().As4(), make([]byte, 2)
		binary.BigEndian.PutUint16(tp, to.Port())
		ex = append(ex,
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: a[:]},
			&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p},
			&expr.Immediate{Register: 1, Data: ta[:]},
			&expr.Immediate{Register: 2, Data: tp},
			&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegProtoMin: 2, Specified: true},
		)
		c.AddRule(&nftables.Rule{Table: serviceNATTable, Chain: ch, Exprs: ex})
	}
	rule("prerouting", nftables.ChainHookPrerouting, args[2], pods)
	rule("output", nftables.ChainHookOutput, "", local)
	return c.Flush()
}
