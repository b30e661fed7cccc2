package kubectlimp

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/controller/impvmpool"
)

// rolloutCommand is `kubectl imp rollout status|history|undo POOL`, for ImpVMPools as
// `kubectl rollout` is for Deployments.
func (o *options) rolloutCommand() *cobra.Command {
	var toRevision int64
	var timeout time.Duration
	rollout := &cobra.Command{Use: "rollout", Short: "Follow, list or undo the rollouts of an ImpVMPool (impvmpool/NAME or NAME)"}
	status := &cobra.Command{Use: "status POOL", Short: "Wait until a pool's rollout is complete (every member of the current template, available)",
		Args: cobra.ExactArgs(1), RunE: func(c *cobra.Command, args []string) error {
			o.timeout = timeout // this command's bound alone
			return o.run(o.rolloutStatus)(c, args)
		}}
	status.Flags().DurationVar(&timeout, "timeout", 10*time.Minute, "give up after this long")
	history := &cobra.Command{Use: "history POOL", Short: "List a pool's revisions", Args: cobra.ExactArgs(1), RunE: o.run(o.rolloutHistory)}
	undo := &cobra.Command{Use: "undo POOL [--to-revision N]", Short: "Roll a pool back to its previous revision (or revision N)",
		Args: cobra.ExactArgs(1), RunE: o.run(func(ctx context.Context, c client.Client, ns string, args []string) error {
			return o.rolloutUndo(ctx, c, ns, args[0], toRevision)
		})}
	undo.Flags().Int64Var(&toRevision, "to-revision", 0, "the revision to roll back to (0: the one before the current)")
	rollout.AddCommand(status, history, undo)
	return rollout
}

func poolName(arg string) (string, error) {
	kind, name, found := strings.Cut(arg, "/")
	if !found {
		return arg, nil
	}
	switch kind {
	case "impvmpool", "impvmpools", "impvmp", "impvmpool.imp.dev", "impvmpools.imp.dev":
		return name, nil
	}
	return "", fmt.Errorf("kubectl imp rollout acts on ImpVMPools (impvmpool/NAME), not %s", kind)
}

func (o *options) pool(ctx context.Context, c client.Client, ns, arg string) (*impv1.ImpVMPool, error) {
	name, err := poolName(arg)
	if err != nil {
		return nil, err
	}
	p := &impv1.ImpVMPool{}
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, p); err != nil {
		return nil, fmt.Errorf("ImpVMPool %s in namespace %s: %w", name, ns, err)
	}
	return p, nil
}

// rolloutStatus prints the pool's progress until its rollout is complete.
func (o *options) rolloutStatus(ctx context.Context, c client.Client, ns string, args []string) error {
	last := ""
	for {
		p, err := o.pool(ctx, c, ns, args[0])
		if err != nil {
			return err
		}
		if p.Spec.UpdateStrategy.Type == impv1.PoolOnDelete {
			return fmt.Errorf("impvmpool %q: rollout status is only available for the RollingUpdate strategy (OnDelete replaces members only when they are deleted)", p.Name)
		}
		want := int32(1)
		if p.Spec.Replicas != nil {
			want = *p.Spec.Replicas
		}
		st := p.Status
		var msg string
		switch {
		case st.ObservedGeneration < p.Generation:
			msg = "Waiting for the pool's spec to be observed..."
		case st.UpdatedReplicas < want:
			msg = fmt.Sprintf("Waiting for rollout to finish: %d of %d members are of the new template...", st.UpdatedReplicas, want)
		case st.Replicas > st.UpdatedReplicas:
			msg = fmt.Sprintf("Waiting for rollout to finish: %d old members are pending removal...", st.Replicas-st.UpdatedReplicas)
		case st.AvailableReplicas < st.UpdatedReplicas:
			msg = fmt.Sprintf("Waiting for rollout to finish: %d of %d updated members are available...", st.AvailableReplicas, st.UpdatedReplicas)
		default:
			fmt.Fprintf(o.out, "impvmpool %q successfully rolled out\n", p.Name)
			return nil
		}
		if c := meta.FindStatusCondition(st.Conditions, impv1.PoolReplicaFailureCondition); c != nil && c.Status == "True" {
			msg += " (" + c.Reason + ": " + c.Message + ")"
		}
		if msg != last {
			fmt.Fprintln(o.out, msg)
			last = msg
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("impvmpool %q: %s: %w", p.Name, msg, ctx.Err())
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// revisionsOf are the pool's ControllerRevisions, oldest first.
func revisionsOf(ctx context.Context, c client.Client, p *impv1.ImpVMPool) ([]appsv1.ControllerRevision, error) {
	var list appsv1.ControllerRevisionList
	if err := c.List(ctx, &list, client.InNamespace(p.Namespace), client.MatchingLabels{impv1.PoolLabel: p.Name}); err != nil {
		return nil, fmt.Errorf("listing the revisions of ImpVMPool %s: %w", p.Name, err)
	}
	out := slices.DeleteFunc(list.Items, func(cr appsv1.ControllerRevision) bool {
		return !metav1.IsControlledBy(&cr, p)
	})
	slices.SortFunc(out, func(a, b appsv1.ControllerRevision) int { return int(a.Revision - b.Revision) })
	return out, nil
}

func (o *options) rolloutHistory(ctx context.Context, c client.Client, ns string, args []string) error {
	p, err := o.pool(ctx, c, ns, args[0])
	if err != nil {
		return err
	}
	revs, err := revisionsOf(ctx, c, p)
	if err != nil {
		return err
	}
	current := currentRevision(p, revs)
	tw := tabwriter.NewWriter(o.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "REVISION\tNAME\tIMAGE\t")
	for _, cr := range revs {
		image := "?"
		if t, err := impvmpool.TemplateOf(&cr); err == nil {
			image = t.Spec.Image
		}
		mark := ""
		if cr.Name == current {
			mark = "(current)"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\n", cr.Revision, cr.Name, image, mark)
	}
	return tw.Flush()
}

// rolloutUndo writes a revision's template back into the pool (the controller then rolls it
// out, and renumbers that revision as the newest).
func (o *options) rolloutUndo(ctx context.Context, c client.Client, ns, arg string, to int64) error {
	p, err := o.pool(ctx, c, ns, arg)
	if err != nil {
		return err
	}
	revs, err := revisionsOf(ctx, c, p)
	if err != nil {
		return err
	}
	current := currentRevision(p, revs)
	var target *appsv1.ControllerRevision
	for i := len(revs) - 1; i >= 0; i-- {
		cr := &revs[i]
		if (to == 0 && cr.Name != current) || (to != 0 && cr.Revision == to) {
			target = cr
			break
		}
	}
	if target == nil {
		if to != 0 {
			return fmt.Errorf("impvmpool %q has no revision %d (kubectl imp rollout history %s)", p.Name, to, p.Name)
		}
		return fmt.Errorf("impvmpool %q has no revision before the current one", p.Name)
	}
	if target.Name == current {
		fmt.Fprintf(o.out, "impvmpool %q is at revision %d already: skipped rollback\n", p.Name, target.Revision)
		return nil
	}
	if _, err := impvmpool.TemplateOf(target); err != nil {
		return err
	}
	// The revision's template as the operator recorded it (not re-encoded by this plugin's
	// types, which may lack a field of the operator's), guarded by the resourceVersion read:
	// a pool changed since is not overwritten.
	rv, _ := json.Marshal(p.ResourceVersion)
	patch := fmt.Appendf(nil, `[{"op":"test","path":"/metadata/resourceVersion","value":%s},{"op":"replace","path":"/spec/template","value":%s}]`, rv, target.Data.Raw)
	if err := c.Patch(ctx, p, client.RawPatch(types.JSONPatchType, patch)); err != nil {
		return fmt.Errorf("rolling impvmpool %q back to revision %d: %w", p.Name, target.Revision, err)
	}
	fmt.Fprintf(o.out, "impvmpool %q rolled back to revision %d\n", p.Name, target.Revision)
	return nil
}

// currentRevision is the name of the pool's current revision: the operator's word
// (status.updateRevision) once it has seen the pool's spec, else the newest revision. Not a
// hash computed here: this plugin's types may encode a template otherwise than the operator's.
func currentRevision(p *impv1.ImpVMPool, revs []appsv1.ControllerRevision) string {
	if p.Status.ObservedGeneration == p.Generation && p.Status.UpdateRevision != "" {
		return impvmpool.RevisionName(p.Name, p.Status.UpdateRevision)
	}
	if len(revs) == 0 {
		return ""
	}
	return revs[len(revs)-1].Name
}
