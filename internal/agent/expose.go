package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/endpoint"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/steps"
)

// exposer is the expose step's view of the agent: the node's endpoint addresses (its ImpNode's
// block, the VMs' records) and the network namespaces that forward them.
type exposer struct {
	a     *Agent
	alloc *endpoint.Allocator
	// waiting holds the VMs told they wait for the node's block (one Event each).
	waiting sync.Map
}

var _ steps.Exposer = (*exposer)(nil)

func newExposer(a *Agent) *exposer {
	x := &exposer{a: a}
	x.alloc = &endpoint.Allocator{
		Block: func(ctx context.Context) (netip.Prefix, error) {
			n := &impv1.ImpNode{}
			if err := a.Client.Get(ctx, types.NamespacedName{Name: a.Opts.NodeName}, n); err != nil {
				return netip.Prefix{}, fmt.Errorf("reading ImpNode %s: %w", a.Opts.NodeName, err)
			}
			if n.Spec.EndpointCIDR == "" {
				return netip.Prefix{}, endpoint.ErrNoBlock
			}
			return netip.ParsePrefix(n.Spec.EndpointCIDR)
		},
		Recorded: func() (map[netip.Addr]string, error) {
			dirs, err := os.ReadDir(filepath.Join(a.Opts.StateDir, "vms"))
			if err != nil {
				return nil, err
			}
			held := map[netip.Addr]string{}
			for _, d := range dirs {
				m, err := readMeta(filepath.Join(a.Opts.StateDir, "vms", d.Name()))
				if err != nil {
					continue
				}
				if e, err := netip.ParseAddr(m.Endpoint); err == nil {
					held[e] = string(m.UID)
				}
			}
			return held, nil
		},
	}
	return x
}

// Expose gives the VM its endpoint address and forwards its declared ports there.
func (x *exposer) Expose(ctx context.Context, vm *impv1.ImpVM, at hostnet.Attachment, want netip.Addr) (netip.Addr, error) {
	ports := declaredPorts(vm)
	if len(ports) == 0 {
		return netip.Addr{}, x.a.net.Unexpose(string(vm.UID))
	}
	e, err := x.alloc.Assign(ctx, string(vm.UID), want)
	if errors.Is(err, endpoint.ErrNoBlock) && x.a.Opts.EndpointBlocks {
		if _, told := x.waiting.LoadOrStore(vm.UID, true); !told {
			x.a.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "WaitingForEndpointBlock", "Expose",
				"The VM declares ports; it starts once the operator has given node %s its endpoint block", x.a.Opts.NodeName)
		}
		return netip.Addr{}, plan.WaitFor(time.Second) // the operator assigns it soon
	}
	x.waiting.Delete(vm.UID)
	if errors.Is(err, endpoint.ErrNoBlock) {
		ctrl.LoggerFrom(ctx).Info("the VM declares ports but the node has no endpoint block: no Service reaches it")
		x.a.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "NotExposed", "Expose",
			"Node %s has no endpoint block (the operator's --endpoint-cidr): no Service reaches the VM", x.a.Opts.NodeName)
		return netip.Addr{}, x.a.net.Unexpose(string(vm.UID))
	}
	if err != nil {
		return netip.Addr{}, err
	}
	if err := x.a.net.Expose(at.Network, string(vm.UID), at.IP, hostnet.Exposure{Endpoint: e, Ports: ports}); err != nil {
		return netip.Addr{}, err
	}
	return e, nil
}

// declaredPorts are the VM's spec.ports for hostnet.
func declaredPorts(vm *impv1.ImpVM) []hostnet.Port {
	var out []hostnet.Port
	for _, p := range vm.Spec.Ports {
		proto := byte(6) // TCP
		if p.Protocol == corev1.ProtocolUDP {
			proto = 17
		}
		out = append(out, hostnet.Port{Protocol: proto, Port: uint16(p.Port)})
	}
	return out
}
