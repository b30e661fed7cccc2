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

// Report merge-patches status.runtime, and nothing else, when it differs: the whole of it,
// the run's idle marks (idleSince, wakeRequested) included.
func (r *Reporter) Report(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error {
	return r.report(ctx, vm, rt, nil)
}

// ReportRun is Report for a run's watcher (the monitor), which knows the run but not its idle
// marks: it writes every field of status.runtime but idleSince and wakeRequested, which it
// leaves as they are (the idle meter's and the stand-in's, written with Mark).
func (r *Reporter) ReportRun(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error {
	return r.report(ctx, vm, rt, idleMarks)
}

// idleMarks are the fields of status.runtime that only Mark's callers know.
var idleMarks = []string{"idleSince", "wakeRequested"}

func (r *Reporter) report(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus, keep []string) error {
	key := client.ObjectKeyFromObject(vm)
	r.mu.Lock()
	r.reports[key]++ // voids a deferred report
	r.mu.Unlock()
	if cur := vm.Status.Runtime; cur != nil && cur.Instance == rt.Instance && cur.Run == rt.Run && cur.State == rt.State &&
		cur.GuestReady == rt.GuestReady && ptr.Equal(cur.Ready, rt.Ready) && cur.Endpoint == rt.Endpoint && cur.Message == rt.Message && cur.DisksRemoved == rt.DisksRemoved &&
		(keep != nil || cur.IdleSince.Equal(rt.IdleSince) && cur.WakeRequested.Equal(rt.WakeRequested)) {
		return nil
	}
	if keep != nil && vm.Status.Runtime != nil { // what the caller's copy holds of the kept fields is not written
		rt.IdleSince, rt.WakeRequested = vm.Status.Runtime.IdleSince, vm.Status.Runtime.WakeRequested
	}
	patch, err := runtimePatch(rt, keep, "")
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
func RuntimePatch(rt impv1.RuntimeStatus) ([]byte, error) { return runtimePatch(rt, nil, "") }

// runtimePatch is RuntimePatch naming none of the fields keep, and, with resourceVersion, a
// precondition on it (the API server refuses the patch with a Conflict if the VM changed).
func runtimePatch(rt impv1.RuntimeStatus, keep []string, resourceVersion string) ([]byte, error) {
	fields, err := runtimeMap(rt)
	if err != nil {
		return nil, err
	}
	for _, f := range runtimeFields {
		if _, ok := fields[f]; !ok {
			fields[f] = nil
		}
	}
	for _, f := range keep {
		delete(fields, f)
	}
	return statusPatch(fields, resourceVersion)
}

func runtimeMap(rt impv1.RuntimeStatus) (map[string]any, error) {
	fields := map[string]any{}
	raw, err := json.Marshal(rt)
	if err != nil {
		return nil, err
	}
	return fields, json.Unmarshal(raw, &fields)
}

func statusPatch(runtime map[string]any, resourceVersion string) ([]byte, error) {
	p := map[string]any{"status": map[string]any{"runtime": runtime}}
	if resourceVersion != "" {
		p["metadata"] = map[string]any{"resourceVersion": resourceVersion}
	}
	return json.Marshal(p)
}

// Mark writes what set changes of vm's status.runtime, and only that (the idle meter's
// idleSince, the stand-in's wakeRequested and message), on the version of vm its caller read:
// if the VM changed since (a cache lagging a resume, a new run), the API server refuses the
// write with a Conflict and nothing is written. A vm with no runtime is not marked.
func (r *Reporter) Mark(ctx context.Context, vm *impv1.ImpVM, set func(rt *impv1.RuntimeStatus)) error {
	if vm.Status.Runtime == nil {
		return nil
	}
	if vm.ResourceVersion == "" {
		return fmt.Errorf("marking %s: the VM was read without its resourceVersion", vm.Name)
	}
	cur := *vm.Status.Runtime
	next := *cur.DeepCopy()
	set(&next)
	before, err := runtimeMap(cur)
	if err != nil {
		return err
	}
	after, err := runtimeMap(next)
	if err != nil {
		return err
	}
	changed := map[string]any{}
	for _, f := range runtimeFields {
		if !reflect.DeepEqual(before[f], after[f]) {
			changed[f] = after[f] // nil when unset: removed
		}
	}
	if len(changed) == 0 {
		return nil
	}
	patch, err := statusPatch(changed, vm.ResourceVersion)
	if err != nil {
		return err
	}
	obj := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, Name: vm.Name}}
	if err := r.Client.Status().Patch(ctx, obj, client.RawPatch(types.MergePatchType, patch)); err != nil {
		return fmt.Errorf("marking the run of %s: %w", vm.Name, err)
	}
	vm.Status.Runtime, vm.ResourceVersion = &next, obj.ResourceVersion
	return nil
}
