// Package scheme builds the runtime.Scheme IMP's binaries and tests use: Kubernetes' built-in
// kinds and the imp.dev/v1alpha1 API.
package scheme

import (
	"errors"
	"fmt"

	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// New returns a scheme with the built-in kinds and IMP's.
func New() (*runtime.Scheme, error) {
	s := runtime.NewScheme()
	if err := errors.Join(clientgoscheme.AddToScheme(s), impv1.AddToScheme(s)); err != nil {
		return nil, fmt.Errorf("building the scheme: %w", err)
	}
	return s, nil
}
