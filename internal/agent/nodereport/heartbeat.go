package nodereport

import (
	"context"
	"fmt"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Heartbeat renews the node's agent Lease in IMP's namespace every HeartbeatInterval: what
// says the agent lives. It goes to the operator only (no agent watches Leases), where an
// ImpNode status write would reach every agent of the cluster.
type Heartbeat struct {
	Client    client.Client
	APIReader client.Reader
	// Namespace is IMP's, where the Lease is.
	Namespace string
	NodeName  string
	Interval  time.Duration

	// lease is the last Lease written.
	lease *coordinationv1.Lease
	// reported is when the fallback last wrote the ImpNode's heartbeatTime.
	reported time.Time
}

// NeedLeaderElection: every agent beats for its own node.
func (*Heartbeat) NeedLeaderElection() bool { return false }

func (h *Heartbeat) Start(ctx context.Context) error {
	t := time.NewTicker(h.Interval)
	defer t.Stop()
	for {
		l, err := RenewHeartbeat(ctx, h.Client, h.APIReader, h.Namespace, h.NodeName, h.Interval, h.lease)
		if err != nil && ctx.Err() == nil {
			ctrl.LoggerFrom(ctx).Error(err, "renewing the agent's heartbeat Lease; beating in the ImpNode instead")
			h.fallback(ctx)
		}
		h.lease = l
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// fallback beats in the ImpNode's heartbeatTime, as agents before the Lease did, every third
// interval at most, when the Lease cannot be written (IMP's namespace missing, its Role not
// granted): the node must not look dead because of that.
func (h *Heartbeat) fallback(ctx context.Context) {
	if time.Since(h.reported) < 3*h.Interval {
		return
	}
	now := metav1.Now()
	patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"status":{"heartbeatTime":%q}}`, now.UTC().Format(time.RFC3339)))
	if err := h.Client.Status().Patch(ctx, &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: h.NodeName}}, patch); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "beating in the ImpNode")
		return
	}
	h.reported = time.Now()
}

// RenewHeartbeat writes node's agent Lease in namespace ns with the time now, and returns it:
// an update of last (the Lease written before) when there is one, else a read (r, uncached)
// and an update, else a create. interval is how often it is renewed.
func RenewHeartbeat(ctx context.Context, w client.Writer, r client.Reader, ns, node string, interval time.Duration, last *coordinationv1.Lease) (*coordinationv1.Lease, error) {
	now := metav1.NewMicroTime(time.Now())
	name := impv1.AgentLeasePrefix + node
	if last != nil {
		l := last.DeepCopy()
		l.Spec.RenewTime = &now
		if err := w.Update(ctx, l); err == nil {
			return l, nil
		}
		// A conflict, or it was deleted: read it again.
	}
	l := &coordinationv1.Lease{}
	err := r.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, l)
	switch {
	case apierrors.IsNotFound(err):
		l = &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{impv1.AgentLeaseLabel: "true"}},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(node), RenewTime: &now,
				LeaseDurationSeconds: ptr.To(max(int32(4*interval/time.Second), 1))},
		}
		if err := w.Create(ctx, l); err != nil {
			return nil, fmt.Errorf("creating Lease %s/%s: %w", ns, name, err)
		}
	case err != nil:
		return nil, fmt.Errorf("reading Lease %s/%s: %w", ns, name, err)
	default:
		l.Spec.RenewTime, l.Spec.HolderIdentity = &now, ptr.To(node)
		if l.Labels[impv1.AgentLeaseLabel] != "true" { // the operator watches only labelled ones
			if l.Labels == nil {
				l.Labels = map[string]string{}
			}
			l.Labels[impv1.AgentLeaseLabel] = "true"
		}
		if err := w.Update(ctx, l); err != nil {
			return nil, fmt.Errorf("renewing Lease %s/%s: %w", ns, name, err)
		}
	}
	return l, nil
}
