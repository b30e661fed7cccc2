package kubectlimp

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// migrateCommands are migrate (one VM) and drain/undrain (a node's VMs).
func (o *options) migrateCommands() []*cobra.Command {
	var to string
	var timeout time.Duration
	bounded := func(v verb) func(*cobra.Command, []string) error {
		return func(c *cobra.Command, args []string) error {
			o.timeout = timeout // this command's bound alone
			return o.run(v)(c, args)
		}
	}
	migrate := &cobra.Command{Use: "migrate VM [--to NODE]", Short: "Move a running VM to another node with its memory (an ImpVMMigration), and wait until it runs there",
		Args: cobra.ExactArgs(1), RunE: bounded(func(ctx context.Context, c client.Client, ns string, args []string) error {
			return o.migrate(ctx, c, ns, args[0], to)
		})}
	migrate.Flags().StringVar(&to, "to", "", "the node to move it to (default: placement chooses)")
	migrate.Flags().BoolVar(&o.wait, "wait", true, "wait until the migration succeeded or failed")
	migrate.Flags().DurationVar(&timeout, "timeout", 15*time.Minute, "give up waiting after this long")
	drain := &cobra.Command{Use: "drain NODE", Short: "Evacuate a node: cordon it, taint it " + impv1.EvacuateTaint + ":NoExecute, and wait while its VMs with evictionStrategy Migrate move off; VMs with None stay",
		Args: cobra.ExactArgs(1), RunE: bounded(func(ctx context.Context, c client.Client, _ string, args []string) error {
			return o.drain(ctx, c, args[0])
		})}
	drain.Flags().BoolVar(&o.wait, "wait", true, "wait until no VM with evictionStrategy Migrate is left on the node")
	drain.Flags().DurationVar(&timeout, "timeout", time.Hour, "give up waiting after this long")
	undrain := &cobra.Command{Use: "undrain NODE", Short: "End a node's evacuation: remove the taint " + impv1.EvacuateTaint + " and uncordon it",
		Args: cobra.ExactArgs(1), RunE: bounded(func(ctx context.Context, c client.Client, _ string, args []string) error {
			return o.setEvacuation(ctx, c, args[0], false)
		})}
	return []*cobra.Command{migrate, drain, undrain}
}

// migrate makes an ImpVMMigration of the VM name and, with --wait, follows it to its end.
func (o *options) migrate(ctx context.Context, c client.Client, ns, name, to string) error {
	vm, err := o.get(ctx, c, ns, name)
	if err != nil {
		return err
	}
	mig := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: ns, GenerateName: vm.Name + "-"},
		Spec: impv1.ImpVMMigrationSpec{VMName: vm.Name, TargetNode: to}}
	if err := c.Create(ctx, mig); err != nil {
		return err
	}
	fmt.Fprintf(o.out, "impvmmigration/%s created: moving impvm/%s off node %s\n", mig.Name, vm.Name, vm.Status.NodeName)
	if !o.wait {
		return nil
	}
	last := impv1.MigrationPhase("")
	for {
		if err := c.Get(ctx, client.ObjectKeyFromObject(mig), mig); err != nil {
			return err
		}
		st := &mig.Status
		if st.Phase != last {
			last = st.Phase
			switch st.Phase {
			case impv1.MigrationPreparing:
				fmt.Fprintf(o.out, "  preparing node %s\n", st.TargetNode)
			case impv1.MigrationTransferring:
				fmt.Fprintf(o.out, "  transferring from node %s\n", st.SourceNode)
			case impv1.MigrationCommitted:
				fmt.Fprintf(o.out, "  committed: the VM is node %s's (paused %v)\n", st.TargetNode, pausedFor(st.Downtime))
			case impv1.MigrationSucceeded:
				fmt.Fprintf(o.out, "impvm/%s runs on node %s: paused %v, %d MiB sent, %v in all\n", vm.Name, st.TargetNode, pausedFor(st.Downtime),
					st.BytesMoved>>20, since(st.StartedAt, st.CompletedAt))
				return nil
			case impv1.MigrationFailed:
				return fmt.Errorf("impvmmigration/%s failed (%s): %s", mig.Name, st.Reason, st.Message)
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("impvmmigration/%s is %s: %w", mig.Name, st.Phase, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func pausedFor(d *metav1.Duration) time.Duration {
	if d == nil {
		return 0
	}
	return d.Round(time.Millisecond)
}

func since(from, to *metav1.Time) time.Duration {
	if from == nil || to == nil {
		return 0
	}
	return to.Sub(from.Time).Round(time.Millisecond)
}

// setEvacuation cordons the node and taints it EvacuateTaint:NoExecute (on), or undoes both.
func (o *options) setEvacuation(ctx context.Context, c client.Client, name string, on bool) error {
	node := &corev1.Node{}
	if err := c.Get(ctx, types.NamespacedName{Name: name}, node); err != nil {
		return err
	}
	orig := node.DeepCopy()
	node.Spec.Unschedulable = on
	node.Spec.Taints = slices.DeleteFunc(node.Spec.Taints, func(t corev1.Taint) bool { return t.Key == impv1.EvacuateTaint })
	if on {
		node.Spec.Taints = append(node.Spec.Taints, corev1.Taint{Key: impv1.EvacuateTaint, Effect: corev1.TaintEffectNoExecute})
	}
	if err := c.Patch(ctx, node, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return fmt.Errorf("node %s: %w", name, err)
	}
	if on {
		fmt.Fprintf(o.out, "node/%s cordoned and tainted %s:NoExecute\n", name, impv1.EvacuateTaint)
	} else {
		fmt.Fprintf(o.out, "node/%s uncordoned, its taint %s removed\n", name, impv1.EvacuateTaint)
	}
	return nil
}

// drain evacuates the node and, with --wait, prints each VM's way until no VM to move is left.
func (o *options) drain(ctx context.Context, c client.Client, name string) error {
	if err := o.setEvacuation(ctx, c, name, true); err != nil {
		return err
	}
	if !o.wait {
		return nil
	}
	said := map[string]string{}
	say := func(key, line string) {
		if said[key] != line {
			said[key] = line
			fmt.Fprintln(o.out, line)
		}
	}
	for {
		var vms impv1.ImpVMList
		if err := c.List(ctx, &vms, client.MatchingFields{"status.nodeName": name}); err != nil {
			return err
		}
		left := 0
		for _, vm := range vms.Items {
			key := vm.Namespace + "/" + vm.Name
			switch {
			case vm.Spec.EvictionStrategy != impv1.EvictionMigrate:
				say(key, fmt.Sprintf("  impvm %s stays (evictionStrategy None)", key))
			case vm.Status.Phase == impv1.VMSucceeded || vm.Status.Phase == impv1.VMFailed || !vm.DeletionTimestamp.IsZero():
			case vm.Status.Migration != nil && vm.Status.Migration.TargetNode != "":
				left++
				say(key, fmt.Sprintf("  impvm %s moving to node %s (impvmmigration/%s)", key, vm.Status.Migration.TargetNode, vm.Status.Migration.Name))
			default:
				left++
				say(key, fmt.Sprintf("  impvm %s waiting to move", key))
			}
		}
		if left == 0 {
			fmt.Fprintf(o.out, "node/%s evacuated: no VM with evictionStrategy Migrate is left on it\n", name)
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("node/%s: %d VMs with evictionStrategy Migrate are still on it (their ImpVMMigrations, label %s=%s, say why): %w",
				name, left, impv1.EvacuationLabel, name, ctx.Err())
		case <-time.After(time.Second):
		}
	}
}
