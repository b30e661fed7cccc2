package kubectlimp

import (
	"context"
	"fmt"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// claim creates a claim of the ImpWarmPool POOL: an ImpVM with warmPoolRef, named NAME or
// <pool>-<random>, with the pool's network and the --env given; with --wait, it waits until the
// VM is Ready and says how it started (warm: the member it was handed; restored) and how long
// that took.
func (o *options) claim(ctx context.Context, c client.Client, ns string, args []string) error {
	pool := &impv1.ImpWarmPool{}
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: args[0]}, pool); err != nil {
		return fmt.Errorf("impwarmpool/%s: %w", args[0], err)
	}
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, GenerateName: pool.Name + "-"},
		Spec: impv1.ImpVMSpec{WarmPoolRef: &impv1.WarmPoolReference{Name: pool.Name}, NetworkRef: pool.Spec.NetworkRef.DeepCopy()}}
	if len(args) > 1 {
		vm.GenerateName, vm.Name = "", args[1]
	}
	for _, kv := range o.env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return fmt.Errorf("--env %q: want KEY=VALUE", kv)
		}
		vm.Spec.Env = append(vm.Spec.Env, impv1.EnvVar{Name: k, Value: v})
	}
	began := time.Now()
	if err := c.Create(ctx, vm); err != nil {
		return err
	}
	if !o.wait {
		fmt.Fprintf(o.out, "impvm/%s created\n", vm.Name)
		return nil
	}
	for {
		if err := c.Get(ctx, client.ObjectKeyFromObject(vm), vm); err != nil {
			return err
		}
		st := vm.Status
		if meta.IsStatusConditionTrue(st.Conditions, impv1.ReadyCondition) {
			how := string(st.Start)
			if w := st.Warm; w != nil {
				how += " (member " + w.Member + ")"
			}
			fmt.Fprintf(o.out, "impvm/%s ready on node %s in %v: %s\n", vm.Name, st.NodeName, time.Since(began).Round(time.Millisecond), how)
			return nil
		}
		if st.Phase == impv1.VMFailed {
			return fmt.Errorf("impvm/%s failed: %s", vm.Name, reasonOf(vm))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("impvm/%s is %s (%s): %w", vm.Name, st.Phase, reasonOf(vm), ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// reasonOf is the reason and message of the VM's Ready condition, or its Scheduled one while
// it is not placed.
func reasonOf(vm *impv1.ImpVM) string {
	for _, t := range []string{impv1.ScheduledCondition, impv1.ReadyCondition} {
		if c := meta.FindStatusCondition(vm.Status.Conditions, t); c != nil && c.Status != metav1.ConditionTrue {
			return c.Reason + ": " + c.Message
		}
	}
	return "no reason given"
}
