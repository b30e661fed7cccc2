package operator

import (
	"context"
	"fmt"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// WaitForAdmission creates an ImpVM in namespace ns in dry-run until the API server admits it,
// or timeout passes: a fresh install's mutating policy refuses ImpVM creates with 503 until
// the API server has fetched the new CRD's schema (docs/operator.md), and the chart's
// post-install hook runs this so that `helm install` returns only once ImpVMs are admitted.
// Nothing is stored: a dry run goes through admission and stops there.
func WaitForAdmission(ctx context.Context, c client.Client, ns string, timeout time.Duration, log logr.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	for attempt := 1; ; attempt++ {
		vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, GenerateName: "imp-admission-probe-"},
			Spec: impv1.ImpVMSpec{Image: "registry.invalid/imp/admission-probe:1",
				Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))}}}
		err := c.Create(ctx, vm, client.DryRunAll)
		if err == nil {
			log.Info("ImpVMs are admitted", "after", time.Since(start).Round(time.Millisecond), "attempts", attempt)
			return nil
		}
		log.Info("ImpVMs are not admitted yet", "attempt", attempt, "error", err.Error())
		select {
		case <-ctx.Done():
			return fmt.Errorf("ImpVMs not admitted after %v: %w", timeout, err)
		case <-time.After(time.Second):
		}
	}
}
