// Package runreport writes what the agent observes of a VM's run to the API: status.runtime of
// the ImpVM, and nothing else. It keeps, per VM, the number of reports made or begun, so that a
// report deferred for a while (a run starting, which a faster report of its guest ready
// overtakes) is never written after a later one.
package runreport

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// StatusPatcher is what a Reporter writes with: the API server's status subresource.
type StatusPatcher interface {
	Status() client.SubResourceWriter
}

// Reporter reports the runs of one node's VMs.
type Reporter struct {
	// Client writes the reports.
	Client StatusPatcher
	// Delay is how long ReportLater waits before it writes: a report made or begun meanwhile voids
	// it. Negative writes at once.
	Delay time.Duration

	// mu guards the maps, for their operations alone: never held across a call to the API
	// server.
	mu       sync.Mutex
	reports  map[types.NamespacedName]uint64 // reports made or begun, by VM: a later one voids a deferred one
	deferred map[types.NamespacedName]deferredReport
}

// deferredReport is a report waiting for Delay: number seq of its VM's.
type deferredReport struct {
	seq uint64
	rt  impv1.RuntimeStatus
}

// New is a Reporter writing with c, deferring ReportLater's reports by delay.
func New(c StatusPatcher, delay time.Duration) *Reporter {
	return &Reporter{Client: c, Delay: delay, reports: map[types.NamespacedName]uint64{}, deferred: map[types.NamespacedName]deferredReport{}}
}

// ReportLater makes report rt of vm after Delay, unless another report of the VM is made or begun
// meanwhile; with a negative delay, at once (its error returned).
func (r *Reporter) ReportLater(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error {
	if r.Delay < 0 {
		return r.Report(ctx, vm, rt)
	}
	key := client.ObjectKeyFromObject(vm)
	r.mu.Lock()
	if p, ok := r.deferred[key]; ok && p.seq == r.reports[key] && equality.Semantic.DeepEqual(p.rt, rt) {
		r.mu.Unlock()
		return nil // the same report waits already: a start that passes again (a pull under way) does not push it back
	}
	r.reports[key]++
	seq := r.reports[key]
	r.deferred[key] = deferredReport{seq: seq, rt: rt}
	r.mu.Unlock()
	obj := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, Name: vm.Name}}
	logger := log.FromContext(ctx).WithName("agent")
	var attempt func(n int)
	attempt = func(n int) {
		r.mu.Lock()
		current := r.reports[key] == seq
		if p, ok := r.deferred[key]; ok && p.seq == seq {
			delete(r.deferred, key)
		}
		r.mu.Unlock()
		if !current {
			return // overtaken
		}
		err := r.Report(context.Background(), obj, rt) // makes a new report number of its own
		if err == nil {
			return
		}
		logger.Error(err, "reporting the VM's state", "vm", key, "attempt", n)
		if n >= 5 {
			return
		}
		r.mu.Lock()
		overtaken := r.reports[key] != seq+1 // Report took seq+1; another report came after it
		seq++
		r.mu.Unlock()
		if overtaken {
			return
		}
		time.AfterFunc(time.Duration(n)*time.Second, func() { attempt(n + 1) })
	}
	time.AfterFunc(r.Delay, func() { attempt(1) })
	return nil
}

// Since says whether this process has made or deferred a report of vm since it started.
func (r *Reporter) Since(vm *impv1.ImpVM) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.reports[client.ObjectKeyFromObject(vm)] > 0
}

// Forget drops what the Reporter keeps of the VM key: it is gone from the node.
func (r *Reporter) Forget(key types.NamespacedName) {
	r.mu.Lock()
	delete(r.reports, key)
	delete(r.deferred, key)
	r.mu.Unlock()
}

// Report merge-patches status.runtime, and nothing else, when it differs.
func (r *Reporter) Report(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error {
	key := client.ObjectKeyFromObject(vm)
	r.mu.Lock()
	r.reports[key]++ // voids a deferred report
	r.mu.Unlock()
	if cur := vm.Status.Runtime; cur != nil && cur.Instance == rt.Instance && cur.Run == rt.Run && cur.State == rt.State &&
		cur.GuestReady == rt.GuestReady && ptr.Equal(cur.Ready, rt.Ready) && cur.Endpoint == rt.Endpoint && cur.Message == rt.Message && cur.DisksRemoved == rt.DisksRemoved &&
		cur.IdleSince.Equal(rt.IdleSince) && cur.WakeRequested.Equal(rt.WakeRequested) {
		return nil
	}
	patch, err := RuntimePatch(rt)
	if err != nil {
		return err
	}
	obj := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, Name: vm.Name}}
	if err := r.Client.Status().Patch(ctx, obj, client.RawPatch(types.MergePatchType, patch)); err != nil {
		if apierrors.IsNotFound(err) {
			return nil // the VM is gone: nothing to report to
		}
		return fmt.Errorf("reporting %s of %s: %w", rt.State, vm.Name, err)
	}
	vm.Status.Runtime = &rt
	return nil
}

// runtimeFields are the JSON names of status.runtime's fields.
var runtimeFields = func() []string {
	var names []string
	t := reflect.TypeFor[impv1.RuntimeStatus]()
	for i := range t.NumField() {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		names = append(names, name)
	}
	return names
}()

// RuntimePatch is the merge patch of an ImpVM's status that reports rt: it names every field
// of status.runtime, null when unset, so that the report replaces the previous one whole (a
// merge patch keeps the fields it does not name), and touches nothing else.
func RuntimePatch(rt impv1.RuntimeStatus) ([]byte, error) {
	fields := map[string]any{}
	raw, err := json.Marshal(rt)
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(raw, &fields); err != nil {
		return nil, err
	}
	for _, f := range runtimeFields {
		if _, ok := fields[f]; !ok {
			fields[f] = nil
		}
	}
	return json.Marshal(map[string]any{"status": map[string]any{"runtime": fields}})
}
