// Package snapshotsecret carries what a node needs to push or pull an ImpVMSnapshot: the
// snapshot's encryption key and its registry credentials, in a Secret of IMP's namespace that
// the operator writes and agents read (they read no Secret of a tenant's namespace). The key is
// made once, when the snapshot is given to a node, and goes with the snapshot.
package snapshotsecret

import (
	"context"
	"crypto/rand"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Keys of the Secret.
const (
	// KeyKey is the snapshot's 32-byte encryption key.
	KeyKey = "key"
	// DockerConfigKey is the tenant's registry credentials (a copy of spec.registry.secretRef).
	DockerConfigKey = corev1.DockerConfigJsonKey
)

// Name is the Secret's name for the snapshot with uid.
func Name(uid types.UID) string { return "imp-snapshot-" + string(uid) }

// ErrNoCredentials: spec.registry.secretRef names no Secret of the snapshot's namespace.
type ErrNoCredentials struct{ Name string }

func (e ErrNoCredentials) Error() string {
	return fmt.Sprintf("Secret %q with the registry's credentials does not exist", e.Name)
}

// Ensure writes the Secret of snap in ns unless it exists: a fresh key, and a copy of the
// registry credentials snap names (read with r, from snap's namespace).
func Ensure(ctx context.Context, c client.Client, r client.Reader, ns string, snap *impv1.ImpVMSnapshot) error {
	if err := r.Get(ctx, types.NamespacedName{Namespace: ns, Name: Name(snap.UID)}, &corev1.Secret{}); err == nil {
		return nil
	} else if !apierrors.IsNotFound(err) {
		return err
	}
	data := map[string][]byte{}
	if ref := snap.Spec.Registry.SecretRef; ref != nil {
		s := &corev1.Secret{}
		if err := r.Get(ctx, types.NamespacedName{Namespace: snap.Namespace, Name: ref.Name}, s); err != nil {
			if apierrors.IsNotFound(err) {
				return ErrNoCredentials{Name: ref.Name}
			}
			return err
		}
		data[DockerConfigKey] = s.Data[DockerConfigKey]
	}
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return err
	}
	data[KeyKey] = key
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: Name(snap.UID),
		Labels: map[string]string{"app.kubernetes.io/managed-by": "imp"}}, Type: corev1.SecretTypeOpaque, Data: data}
	if err := c.Create(ctx, s); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("writing the key of ImpVMSnapshot %s: %w", snap.Name, err)
	}
	return nil
}

// Read returns the key and registry credentials of the snapshot with uid.
func Read(ctx context.Context, r client.Reader, ns string, uid types.UID) (key, dockerConfig []byte, err error) {
	s := &corev1.Secret{}
	if err := r.Get(ctx, types.NamespacedName{Namespace: ns, Name: Name(uid)}, s); err != nil {
		return nil, nil, fmt.Errorf("reading the snapshot's key: %w", err)
	}
	if len(s.Data[KeyKey]) != 32 {
		return nil, nil, fmt.Errorf("the snapshot's key Secret holds no key")
	}
	return s.Data[KeyKey], s.Data[DockerConfigKey], nil
}

// Delete removes the Secret of the snapshot with uid.
func Delete(ctx context.Context, c client.Client, ns string, uid types.UID) error {
	err := c.Delete(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: Name(uid)}})
	return client.IgnoreNotFound(err)
}
