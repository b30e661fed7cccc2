package nodenet

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
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/endpoint"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/steps"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Exposer gives VMs their endpoint addresses, of the node's block (its ImpNode's), recorded in
// the VMs' metas, and has the network namespaces forward the VMs' declared ports there.
type Exposer struct {
	Client   client.Client
	Recorder events.EventRecorder
	NodeName string
	StateDir string
	Net      *hostnet.Host
	// EndpointBlocks: the operator assigns nodes endpoint blocks, so a VM with ports waits for
	// its node's (agent.Options.EndpointBlocks).
	EndpointBlocks bool

	alloc *endpoint.Allocator
	// waiting holds the VMs told they wait for the node's block (one Event each).
	waiting sync.Map
}

var _ steps.Exposer = (*Exposer)(nil)

// Init readies the exposer, its fields set.
func (x *Exposer) Init() {
	x.alloc = &endpoint.Allocator{
		Block: func(ctx context.Context) (netip.Prefix, error) {
			n := &impv1.ImpNode{}
			if err := x.Client.Get(ctx, types.NamespacedName{Name: x.NodeName}, n); err != nil {
				return netip.Prefix{}, fmt.Errorf("reading ImpNode %s: %w", x.NodeName, err)
			}
			if n.Spec.EndpointCIDR == "" {
				return netip.Prefix{}, endpoint.ErrNoBlock
			}
			return netip.ParsePrefix(n.Spec.EndpointCIDR)
		},
		Recorded: func() (map[netip.Addr]string, error) {
			dirs, err := os.ReadDir(filepath.Join(x.StateDir, "vms"))
			if err != nil {
				return nil, err
			}
			held := map[netip.Addr]string{}
			for _, d := range dirs {
				m, err := vmrun.ReadMeta(filepath.Join(x.StateDir, "vms", d.Name()))
				if err != nil {
					continue
				}
				if e, err := netip.ParseAddr(m.Endpoint); err == nil {
					held[e] = string(m.HostUID())
				}
			}
			return held, nil
		},
	}
}

// Release frees the VM's endpoint address, once nothing of its exposure is left.
func (x *Exposer) Release(uid string) { x.alloc.Release(uid) }

// Expose gives the VM its endpoint address and forwards its declared ports there.
func (x *Exposer) Expose(ctx context.Context, vm *impv1.ImpVM, at hostnet.Attachment, want netip.Addr) (netip.Addr, error) {
	ports := declaredPorts(vm)
	if len(ports) == 0 {
		return netip.Addr{}, x.Net.Unexpose(string(vm.HostUID()))
	}
	e, err := x.alloc.Assign(ctx, string(vm.HostUID()), want)
	if errors.Is(err, endpoint.ErrNoBlock) && x.EndpointBlocks {
		if _, told := x.waiting.LoadOrStore(vm.HostUID(), true); !told {
			x.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "WaitingForEndpointBlock", "Expose",
				"The VM declares ports; it starts once the operator has given node %s its endpoint block", x.NodeName)
		}
		return netip.Addr{}, plan.WaitFor(time.Second) // the operator assigns it soon
	}
	x.waiting.Delete(vm.HostUID())
	if errors.Is(err, endpoint.ErrNoBlock) {
		ctrl.LoggerFrom(ctx).Info("the VM declares ports but the node has no endpoint block: no Service reaches it")
		x.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "NotExposed", "Expose",
			"Node %s has no endpoint block (the operator's --endpoint-cidr): no Service reaches the VM", x.NodeName)
		return netip.Addr{}, x.Net.Unexpose(string(vm.HostUID()))
	}
	if err != nil {
		return netip.Addr{}, err
	}
	if err := x.Net.Expose(at.Network, string(vm.HostUID()), at.IP, hostnet.Exposure{Endpoint: e, Ports: ports}); err != nil {
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
