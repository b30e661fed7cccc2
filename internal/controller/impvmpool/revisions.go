package impvmpool

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"

	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Revision is the hash of a pool's template: the members' PoolRevisionLabel and the suffix of
// the template's ControllerRevision.
func Revision(t *impv1.ImpVMPoolTemplate) string {
	data, _ := json.Marshal(t)
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])[:10]
}

// RevisionName is the name of the ControllerRevision of a pool's revision rev.
func RevisionName(pool string, rev string) string { return pool + "-" + rev }

// TemplateOf is the template a pool's ControllerRevision holds (kubectl imp rollout undo).
func TemplateOf(cr *appsv1.ControllerRevision) (*impv1.ImpVMPoolTemplate, error) {
	t := &impv1.ImpVMPoolTemplate{}
	if err := json.Unmarshal(cr.Data.Raw, t); err != nil {
		return nil, fmt.Errorf("reading the template of ControllerRevision %s: %w", cr.Name, err)
	}
	return t, nil
}

// ensureRevision makes sure the pool's template has a ControllerRevision, numbered after every
// other of the pool's (a template that returns, as after `rollout undo`, is renumbered as a
// StatefulSet's is), and returns its hash.
func (r *Reconciler) ensureRevision(ctx context.Context, pool *impv1.ImpVMPool) (string, []appsv1.ControllerRevision, error) {
	rev := Revision(&pool.Spec.Template)
	revs, err := r.revisions(ctx, pool)
	if err != nil {
		return "", nil, err
	}
	var top int64
	var mine *appsv1.ControllerRevision
	for i := range revs {
		top = max(top, revs[i].Revision)
		if revs[i].Name == RevisionName(pool.Name, rev) {
			mine = &revs[i]
		}
	}
	if mine != nil {
		if mine.Revision < top {
			orig := mine.DeepCopy()
			mine.Revision = top + 1
			if err := r.Client.Patch(ctx, mine, client.MergeFrom(orig)); err != nil {
				return "", nil, fmt.Errorf("renumbering ControllerRevision %s: %w", mine.Name, err)
			}
		}
		return rev, revs, nil
	}
	data, err := json.Marshal(&pool.Spec.Template)
	if err != nil {
		return "", nil, fmt.Errorf("encoding the template of ImpVMPool %s: %w", pool.Name, err)
	}
	cr := &appsv1.ControllerRevision{ObjectMeta: metav1.ObjectMeta{Namespace: pool.Namespace, Name: RevisionName(pool.Name, rev),
		Labels:          map[string]string{impv1.PoolLabel: pool.Name, impv1.PoolRevisionLabel: rev},
		OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(pool, impv1.GroupVersion.WithKind("ImpVMPool"))}},
		Data: runtime.RawExtension{Raw: data}, Revision: top + 1}
	if err := r.Client.Create(ctx, cr); apierrors.IsAlreadyExists(err) {
		// Not among the pool's: another's object of that name (ours would have been listed).
		return "", nil, fmt.Errorf("recording revision %s of ImpVMPool %s: a ControllerRevision %s exists that the pool does not control", rev, pool.Name, cr.Name)
	} else if err != nil {
		return "", nil, fmt.Errorf("recording revision %s of ImpVMPool %s: %w", rev, pool.Name, err)
	}
	return rev, append(revs, *cr), nil
}

// revisions are the pool's ControllerRevisions, from the API server (a revision made by the
// last reconcile must be counted when numbering the next).
func (r *Reconciler) revisions(ctx context.Context, pool *impv1.ImpVMPool) ([]appsv1.ControllerRevision, error) {
	var list appsv1.ControllerRevisionList
	if err := r.APIReader.List(ctx, &list, client.InNamespace(pool.Namespace), client.MatchingLabels{impv1.PoolLabel: pool.Name}); err != nil {
		return nil, fmt.Errorf("listing the revisions of ImpVMPool %s: %w", pool.Name, err)
	}
	out := list.Items[:0]
	for _, cr := range list.Items {
		if metav1.IsControlledBy(&cr, pool) {
			out = append(out, cr)
		}
	}
	return out, nil
}

// pruneRevisions deletes the oldest revisions beyond revisionHistoryLimit that neither the
// template nor any member is of.
func (r *Reconciler) pruneRevisions(ctx context.Context, pool *impv1.ImpVMPool, rev string, revs []appsv1.ControllerRevision, members []member) error {
	limit := 10
	if pool.Spec.RevisionHistoryLimit != nil {
		limit = int(*pool.Spec.RevisionHistoryLimit)
	}
	inUse := map[string]bool{RevisionName(pool.Name, rev): true}
	for _, m := range members {
		if !m.foreign {
			inUse[RevisionName(pool.Name, m.rev)] = true
		}
	}
	var old []appsv1.ControllerRevision
	for _, cr := range revs {
		if !inUse[cr.Name] {
			old = append(old, cr)
		}
	}
	if len(old) <= limit {
		return nil
	}
	slices.SortFunc(old, func(a, b appsv1.ControllerRevision) int { return int(a.Revision - b.Revision) })
	for i := range old[:len(old)-limit] {
		if err := r.Client.Delete(ctx, &old[i]); client.IgnoreNotFound(err) != nil {
			return fmt.Errorf("deleting old revision %s of ImpVMPool %s: %w", old[i].Name, pool.Name, err)
		}
	}
	return nil
}
