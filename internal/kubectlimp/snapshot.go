package kubectlimp

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// snapshot creates an ImpVMSnapshot of a VM: named NAME, or after the VM and the time; with
// --wait, it waits until the snapshot is Ready or failed.
func (o *options) snapshot(ctx context.Context, c client.Client, ns string, args []string) error {
	vm, err := o.get(ctx, c, ns, args[0])
	if err != nil {
		return err
	}
	name := fmt.Sprintf("%s-%d", vm.Name, time.Now().Unix())
	if len(args) > 1 {
		name = args[1]
	}
	snap := &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: impv1.ImpVMSnapshotSpec{VMName: vm.Name}}
	if err := c.Create(ctx, snap); err != nil {
		if apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("an ImpVMSnapshot %s exists already in namespace %s", name, ns)
		}
		return err
	}
	if !o.wait {
		fmt.Fprintf(o.out, "impvmsnapshot/%s created\n", name)
		return nil
	}
	for {
		if err := c.Get(ctx, client.ObjectKeyFromObject(snap), snap); err != nil {
			return err
		}
		switch snap.Status.Phase {
		case impv1.SnapshotReady:
			fmt.Fprintf(o.out, "impvmsnapshot/%s ready on node %s: %s, the VM paused %d ms\n", name, snap.Status.NodeName, snap.Status.Size, snap.Status.PauseMilliseconds)
			return nil
		case impv1.SnapshotFailed:
			return fmt.Errorf("impvmsnapshot/%s failed: %s: %s", name, snap.Status.Reason, snap.Status.Message)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("impvmsnapshot/%s is %s (%s): %w", name, snap.Status.Phase, snap.Status.Message, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// printSnapshots lists the snapshots of the VM named vm in ns, and those of recurring ones.
func printSnapshots(ctx context.Context, c client.Client, w io.Writer, ns, vm string) error {
	var list impv1.ImpVMSnapshotList
	if err := c.List(ctx, &list, client.InNamespace(ns)); err != nil {
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	n := 0
	for _, s := range list.Items {
		if s.Spec.VMName != vm {
			continue
		}
		if n == 0 {
			fmt.Fprintln(tw, "Snapshots:\tNAME\tPHASE\tNODE\tSIZE\tPAUSE\tAGE")
		}
		n++
		size := "-"
		if s.Status.Size != nil {
			size = s.Status.Size.String()
		}
		phase := string(s.Status.Phase)
		if s.Spec.Schedule != "" {
			phase = "every " + s.Spec.Schedule
		}
		fmt.Fprintf(tw, "\t%s\t%s\t%s\t%s\t%dms\t%s\n", s.Name, dash(phase), dash(s.Status.NodeName), size, s.Status.PauseMilliseconds,
			time.Since(s.CreationTimestamp.Time).Round(time.Second))
	}
	return tw.Flush()
}
