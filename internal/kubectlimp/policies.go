package kubectlimp

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"

	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// printPolicies writes which NetworkPolicies of its namespace select vm, and for what: a VM
// no policy of a type selects is not isolated for that type (docs/networking.md).
func printPolicies(ctx context.Context, c client.Client, w io.Writer, vm *impv1.ImpVM) error {
	var list networkingv1.NetworkPolicyList
	if err := c.List(ctx, &list, client.InNamespace(vm.Namespace)); err != nil {
		if apierrors.IsForbidden(err) {
			_, err = fmt.Fprintln(w, "NetworkPolicies:\t(you may not list them)")
		}
		return err
	}
	var names []string
	in, out := false, false
	for _, p := range list.Items {
		sel, err := metav1.LabelSelectorAsSelector(&p.Spec.PodSelector)
		if err != nil || !sel.Matches(labels.Set(vm.Labels)) {
			continue
		}
		types := p.Spec.PolicyTypes
		if len(types) == 0 {
			types = []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}
			if len(p.Spec.Egress) > 0 {
				types = append(types, networkingv1.PolicyTypeEgress)
			}
		}
		in = in || slices.Contains(types, networkingv1.PolicyTypeIngress)
		out = out || slices.Contains(types, networkingv1.PolicyTypeEgress)
		var ts []string
		for _, t := range types {
			ts = append(ts, string(t))
		}
		names = append(names, fmt.Sprintf("%s (%s)", p.Name, strings.Join(ts, ", ")))
	}
	isolated := map[bool]string{true: "isolated", false: "open"}
	_, err := fmt.Fprintf(w, "NetworkPolicies:\tingress %s, egress %s: %s\n", isolated[in], isolated[out], dash(strings.Join(names, ", ")))
	return err
}
