package impvmpool

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"golang.org/x/time/rate"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Default bounds on the members the pools of one namespace make (Reconciler.CreatesPerSecond,
// CreateBurst): a pool scaled from 0 to 100 makes them at once, a pool of 10,000 over minutes.
const (
	DefaultCreatesPerSecond = 20
	DefaultCreateBurst      = 100
)

// withinQuota is what of indices the namespace's ImpQuotas leave room for: a quota's hard.vms
// bounds the VMs that hold a placement, and a VM made now holds one once placed, so the VMs of
// the namespace that are not finished nor being deleted (placed or waiting to be) count. A pool
// of 10,000 replicas under hard.vms 10 makes no more than the room, rather than 10,000 VMs
// that wait QuotaExceeded, made with the operator's identity and priority. The failure says
// which quota stopped it.
func (r *Reconciler) withinQuota(ctx context.Context, ns string, indices []int) ([]int, *createFailure, error) {
	if len(indices) == 0 {
		return nil, nil, nil
	}
	var quotas impv1.ImpQuotaList
	if err := r.Client.List(ctx, &quotas, client.InNamespace(ns)); err != nil {
		return nil, nil, fmt.Errorf("listing the ImpQuotas of namespace %s: %w", ns, err)
	}
	var bound *impv1.ImpQuota
	for i := range quotas.Items {
		q := &quotas.Items[i]
		if q.Spec.Hard.VMs != nil && (bound == nil || *q.Spec.Hard.VMs < *bound.Spec.Hard.VMs) {
			bound = q
		}
	}
	if bound == nil {
		return indices, nil, nil
	}
	var vms impv1.ImpVMList
	if err := r.Client.List(ctx, &vms, client.InNamespace(ns), client.UnsafeDisableDeepCopy); err != nil {
		return nil, nil, fmt.Errorf("listing the VMs of namespace %s: %w", ns, err)
	}
	held := 0
	for _, vm := range vms.Items {
		if vm.DeletionTimestamp.IsZero() && vm.Status.Phase != impv1.VMSucceeded && vm.Status.Phase != impv1.VMFailed {
			held++
		}
	}
	room := max(int(*bound.Spec.Hard.VMs)-held, 0)
	if room >= len(indices) {
		return indices, nil, nil
	}
	return indices[:room], &createFailure{reason: impv1.ReasonQuotaExceeded, message: fmt.Sprintf(
		"ImpQuota %s: the namespace has %d VMs that hold or wait for a placement, of %d (hard.vms): %d more members are not made until some go",
		bound.Name, held, *bound.Spec.Hard.VMs, len(indices)-room)}, nil
}

// pacer bounds the members made per namespace and second, over all the namespace's pools: a
// tenant's pools cannot crowd the API server's priority level the operator's writes share.
type pacer struct {
	mu       sync.Mutex
	limiters map[string]*rate.Limiter
}

// take is how many of n members the namespace may make at now, taken from its budget, and, when
// fewer than n, how long until the budget holds what is left (at most a burst): a pool paced
// tries again once it can make a batch, not every 1/perSecond (each try costs the API server a
// read of the pool and a list of its members).
func (p *pacer) take(ns string, n int, now time.Time, perSecond float64, burst int) (int, time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.limiters == nil {
		p.limiters = map[string]*rate.Limiter{}
	}
	l := p.limiters[ns]
	if l == nil {
		l = rate.NewLimiter(rate.Limit(perSecond), burst)
		p.limiters[ns] = l
	}
	k := min(n, max(int(l.TokensAt(now)), 0))
	if k > 0 {
		l.AllowN(now, k)
	}
	if k == n {
		return k, 0
	}
	want := float64(min(n-k, burst)) - max(l.TokensAt(now), 0)
	return k, time.Duration(want / perSecond * float64(time.Second) * (1 + rand.Float64()/10))
}
