package impvm

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"

	jsonpatch "github.com/evanphx/json-patch/v5"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// StatusPatcher writes a VM's status as a JSON merge patch.
type StatusPatcher interface {
	PatchStatus(ctx context.Context, key types.NamespacedName, patch []byte) error
}

// restStatusPatcher patches impvms/status and does not decode the API server's answer, the
// whole VM: a reconcile has what it wrote, and the VM comes back through the watch, where it
// is decoded once for every controller. (controller-runtime's client decodes the answer into
// the object it patched: a second decode of every VM the operator writes.)
type restStatusPatcher struct{ rc rest.Interface }

// NewStatusPatcher is a StatusPatcher through the API server cfg names, on the HTTP client hc:
// the manager's, so its connection is shared and its user agent, the field manager of the
// operator's other writes, is this one's too (the control-plane bench prints a VM's managers).
func NewStatusPatcher(cfg *rest.Config, hc *http.Client, scheme *runtime.Scheme) (StatusPatcher, error) {
	c := rest.CopyConfig(cfg)
	c.GroupVersion = &impv1.GroupVersion
	c.APIPath = "/apis"
	c.NegotiatedSerializer = serializer.NewCodecFactory(scheme).WithoutConversion()
	rc, err := rest.RESTClientForConfigAndClient(c, hc)
	if err != nil {
		return nil, fmt.Errorf("making the VM status client: %w", err)
	}
	return restStatusPatcher{rc}, nil
}

func (p restStatusPatcher) PatchStatus(ctx context.Context, key types.NamespacedName, patch []byte) error {
	return p.rc.Patch(types.MergePatchType).Namespace(key.Namespace).Resource("impvms").Name(key.Name).
		SubResource("status").Body(patch).Do(ctx).Error()
}

// statusPatch is the JSON merge patch from orig's status to vm's: what client.MergeFrom makes
// for a status write, built from the statuses alone (MergeFrom marshals and compares the whole
// objects, metadata and spec too, for every write).
func statusPatch(orig, vm *impv1.ImpVM) ([]byte, error) {
	type status struct {
		Status *impv1.ImpVMStatus `json:"status"`
	}
	from, err := json.Marshal(status{&orig.Status})
	if err != nil {
		return nil, fmt.Errorf("marshalling the VM's status: %w", err)
	}
	to, err := json.Marshal(status{&vm.Status})
	if err != nil {
		return nil, fmt.Errorf("marshalling the VM's status: %w", err)
	}
	p, err := jsonpatch.CreateMergePatch(from, to)
	if err != nil {
		return nil, fmt.Errorf("computing the VM's status patch: %w", err)
	}
	return p, nil
}
