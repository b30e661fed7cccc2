// Package runsecret carries what a VM's run needs from its namespace's Secrets and ConfigMaps
// to the VM's node without the node's agent reading them. At each new run (a placement, a
// restart) the operator, which alone may read Secrets and ConfigMaps cluster-wide, resolves
// the VM's image pull secrets and env valueFrom references and writes them into one Secret per
// VM in IMP's own namespace, before it publishes the run. The agent may read Secrets in that
// namespace only: a compromised node learns what ImpVMs reference, never any other Secret.
package runsecret

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/accesskeys"
)

// DefaultNamespace is IMP's namespace, where the chart installs it.
const DefaultNamespace = "imp-system"

// Keys and annotations of a run's Secret.
const (
	pullPrefix = "pull."              // + index in spec.imagePullSecrets: a .dockerconfigjson
	envPrefix  = "env."               // + index in spec.env: the resolved value
	volPrefix  = "vol."               // + index in spec.volumes: the volume's files, JSON
	userData   = "cloudinit.userdata" // spec.cloudInit.userDataSecretRef's value
	errKey     = "error"              // why the run's references could not be resolved
	runAnno    = "imp.dev/run"        // "<instance>.<restartCount>": the run it was made for
	vmAnno     = "imp.dev/vm"         // namespace/name of the VM
)

// Needed says whether vm references anything of its namespace a run needs: without, no run
// Secret is written or read.
func Needed(vm *impv1.ImpVM) bool {
	if len(vm.Spec.ImagePullSecrets) > 0 {
		return true
	}
	for _, e := range vm.Spec.Env {
		if e.ValueFrom != nil {
			return true
		}
	}
	for _, v := range vm.Spec.Volumes {
		if v.Secret != nil || v.ConfigMap != nil {
			return true
		}
	}
	return vm.Spec.CloudInit != nil && vm.Spec.CloudInit.UserDataSecretRef != nil || len(vm.Spec.AccessCredentials) > 0
}

// Name is the Secret of the VM with uid.
func Name(uid types.UID) string { return "imp-run-" + string(uid) }

func runOf(vm *impv1.ImpVM) string {
	return fmt.Sprintf("%d.%d", vm.Status.Instance, vm.Status.RestartCount)
}

// Write resolves vm's references with r (an uncached reader: the operator watches no Secret)
// and writes the VM's run Secret into ns for its current run. A reference that cannot be resolved
// is no error here: the Secret says why, and the agent fails the run with it.
func Write(ctx context.Context, c client.Client, r client.Reader, ns string, vm *impv1.ImpVM) error {
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: Name(vm.UID),
		Labels:      map[string]string{"app.kubernetes.io/managed-by": "imp", "imp.dev/node": vm.Status.NodeName},
		Annotations: map[string]string{runAnno: runOf(vm), vmAnno: vm.Namespace + "/" + vm.Name}},
		Type: corev1.SecretTypeOpaque, Data: map[string][]byte{}}
	if err := resolve(ctx, r, vm, s.Data); err != nil {
		if apierrors.IsNotFound(err) || isMissingKey(err) {
			s.Data = map[string][]byte{errKey: []byte(err.Error())}
		} else {
			return err
		}
	}
	cur := &corev1.Secret{}
	switch err := r.Get(ctx, client.ObjectKeyFromObject(s), cur); {
	case apierrors.IsNotFound(err):
		if err := c.Create(ctx, s); err != nil {
			return fmt.Errorf("writing the run's Secret of %s/%s: %w", vm.Namespace, vm.Name, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("reading the run's Secret of %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	cur.Labels, cur.Annotations, cur.Data = s.Labels, s.Annotations, s.Data
	if err := c.Update(ctx, cur); err != nil {
		return fmt.Errorf("writing the run's Secret of %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	return nil
}

type missingKeyError struct{ msg string }

func (e missingKeyError) Error() string { return e.msg }

func isMissingKey(err error) bool {
	var m missingKeyError
	return errors.As(err, &m)
}

func resolve(ctx context.Context, r client.Reader, vm *impv1.ImpVM, data map[string][]byte) error {
	for i, ref := range vm.Spec.ImagePullSecrets {
		var s corev1.Secret
		if err := r.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: ref.Name}, &s); err != nil {
			return fmt.Errorf("reading image pull secret %s: %w", ref.Name, err)
		}
		if d, ok := s.Data[corev1.DockerConfigJsonKey]; ok {
			data[pullPrefix+strconv.Itoa(i)] = d
		}
	}
	for i, e := range vm.Spec.Env {
		src := e.ValueFrom
		if src == nil {
			continue
		}
		switch {
		case src.SecretKeyRef != nil:
			ref := src.SecretKeyRef
			var s corev1.Secret
			if err := r.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: ref.Name}, &s); err != nil {
				return fmt.Errorf("env %s: reading Secret %s: %w", e.Name, ref.Name, err)
			}
			v, ok := s.Data[ref.Key]
			if !ok {
				return missingKeyError{fmt.Sprintf("env %s: Secret %s has no key %s", e.Name, ref.Name, ref.Key)}
			}
			data[envPrefix+strconv.Itoa(i)] = v
		case src.ConfigMapKeyRef != nil:
			ref := src.ConfigMapKeyRef
			var cm corev1.ConfigMap
			if err := r.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: ref.Name}, &cm); err != nil {
				return fmt.Errorf("env %s: reading ConfigMap %s: %w", e.Name, ref.Name, err)
			}
			v, ok := cm.Data[ref.Key]
			if !ok {
				return missingKeyError{fmt.Sprintf("env %s: ConfigMap %s has no key %s", e.Name, ref.Name, ref.Key)}
			}
			data[envPrefix+strconv.Itoa(i)] = []byte(v)
		}
	}
	if ci := vm.Spec.CloudInit; ci != nil && ci.UserDataSecretRef != nil {
		ref := ci.UserDataSecretRef
		key := ref.Key
		if key == "" {
			key = impv1.UserDataKey
		}
		var s corev1.Secret
		if err := r.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: ref.Name}, &s); err != nil {
			return fmt.Errorf("cloudInit.userDataSecretRef: Secret %s in namespace %s: %w", ref.Name, vm.Namespace, err)
		}
		v, ok := s.Data[key]
		if !ok {
			return missingKeyError{fmt.Sprintf("cloudInit.userDataSecretRef: Secret %s in namespace %s has no key %s", ref.Name, vm.Namespace, key)}
		}
		data[userData] = v
	}
	// The SSH keys as they are now; the operator refreshes them while the VM runs
	// (controller/accesscredentials), and a failure to read them is told there, never fails
	// the run.
	if len(vm.Spec.AccessCredentials) > 0 {
		if keys, _, err := accesskeys.Resolve(ctx, r, vm); err == nil {
			data[accesskeys.SecretKey] = keys.Encode()
		}
	}
	for i := range vm.Spec.Volumes {
		files, err := volumeFiles(ctx, r, vm.Namespace, &vm.Spec.Volumes[i])
		if err != nil {
			return err
		}
		if files == nil {
			continue
		}
		b, err := json.Marshal(files)
		if err != nil {
			return err
		}
		data[volPrefix+strconv.Itoa(i)] = b
	}
	return nil
}

// File is one file of a volume of files, as the run's Secret carries it.
type File struct {
	Path string `json:"path"`
	Mode uint32 `json:"mode"`
	Data []byte `json:"data"`
}

// defaultFileMode is a volume's files' mode when neither the item nor the volume sets one,
// as a Pod's.
const defaultFileMode = 0o644

// volumeFiles are the files of v, a Secret or ConfigMap volume of namespace ns (nil for a volume
// of another kind): its items, or every key at a path of its name. A missing object or key is
// an error unless the volume is optional.
func volumeFiles(ctx context.Context, r client.Reader, ns string, v *impv1.Volume) ([]File, error) {
	var (
		kind, name string
		items      []impv1.KeyToPath
		mode       *int32
		optional   bool
		obj        client.Object
		keys       func() map[string][]byte
	)
	switch {
	case v.Secret != nil:
		s := &corev1.Secret{}
		kind, name, items, mode, obj = "Secret", v.Secret.SecretName, v.Secret.Items, v.Secret.DefaultMode, s
		optional = v.Secret.Optional != nil && *v.Secret.Optional
		keys = func() map[string][]byte { return s.Data }
	case v.ConfigMap != nil:
		cm := &corev1.ConfigMap{}
		kind, name, items, mode, obj = "ConfigMap", v.ConfigMap.Name, v.ConfigMap.Items, v.ConfigMap.DefaultMode, cm
		optional = v.ConfigMap.Optional != nil && *v.ConfigMap.Optional
		keys = func() map[string][]byte {
			all := make(map[string][]byte, len(cm.Data)+len(cm.BinaryData))
			for k, d := range cm.BinaryData {
				all[k] = d
			}
			for k, d := range cm.Data {
				all[k] = []byte(d)
			}
			return all
		}
	default:
		return nil, nil
	}
	files := []File{}
	if err := r.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, obj); err != nil {
		if apierrors.IsNotFound(err) && optional {
			return files, nil
		}
		return nil, fmt.Errorf("volume %s: %s %s in namespace %s: %w", v.Name, kind, name, ns, err)
	}
	fileMode := func(m *int32) uint32 {
		switch {
		case m != nil:
			return uint32(*m) & 0o777
		case mode != nil:
			return uint32(*mode) & 0o777
		}
		return defaultFileMode
	}
	data := keys()
	if len(items) == 0 {
		for k, d := range data {
			files = append(files, File{Path: k, Mode: fileMode(nil), Data: d})
		}
		slices.SortFunc(files, func(a, b File) int { return strings.Compare(a.Path, b.Path) })
		return files, nil
	}
	for _, it := range items {
		d, ok := data[it.Key]
		if !ok {
			if optional {
				continue
			}
			return nil, missingKeyError{fmt.Sprintf("volume %s: %s %s in namespace %s has no key %s", v.Name, kind, name, ns, it.Key)}
		}
		files = append(files, File{Path: it.Path, Mode: fileMode(it.Mode), Data: d})
	}
	return files, nil
}

// Delete removes the run Secret of vm, if there.
func Delete(ctx context.Context, c client.Client, ns string, vm *impv1.ImpVM) error {
	err := c.Delete(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: Name(vm.UID)}})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("removing the run's Secret of %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	return nil
}

// Run is what the agent reads of a VM's run Secret.
type Run struct{ data map[string][]byte }

// Read returns the run Secret of vm's current run, read with r from ns (none to read when the
// VM references nothing). A Secret of another run, or one that says the references could not
// be resolved, is an error.
func Read(ctx context.Context, r client.Reader, ns string, vm *impv1.ImpVM) (*Run, error) {
	if !Needed(vm) {
		return &Run{}, nil
	}
	var s corev1.Secret
	if err := r.Get(ctx, types.NamespacedName{Namespace: ns, Name: Name(vm.UID)}, &s); err != nil {
		return nil, fmt.Errorf("reading the run's Secret %s/%s: %w", ns, Name(vm.UID), err)
	}
	if got := s.Annotations[runAnno]; got != runOf(vm) {
		return nil, fmt.Errorf("the run's Secret is for run %q, not %q", got, runOf(vm))
	}
	if msg, ok := s.Data[errKey]; ok {
		return nil, fmt.Errorf("%s", msg)
	}
	return &Run{data: s.Data}, nil
}

// PullConfigs are the VM's image pull secrets' .dockerconfigjson, in order.
func (r *Run) PullConfigs(vm *impv1.ImpVM) [][]byte {
	var out [][]byte
	for i := range vm.Spec.ImagePullSecrets {
		if d, ok := r.data[pullPrefix+strconv.Itoa(i)]; ok {
			out = append(out, d)
		}
	}
	return out
}

// Files are the files of spec.volumes[i], a Secret or ConfigMap volume: none when the run's
// Secret has none for it.
func (r *Run) Files(i int) ([]File, error) {
	b, ok := r.data[volPrefix+strconv.Itoa(i)]
	if !ok {
		return nil, nil
	}
	var files []File
	if err := json.Unmarshal(b, &files); err != nil {
		return nil, fmt.Errorf("the run's Secret holds bad files for volume %d: %w", i, err)
	}
	return files, nil
}

// Env is the resolved value of spec.env[i].
func (r *Run) Env(i int) (string, bool) {
	v, ok := r.data[envPrefix+strconv.Itoa(i)]
	return string(v), ok
}

// UserData is the user data of spec.cloudInit.userDataSecretRef, if the VM names one.
func (r *Run) UserData() ([]byte, bool) {
	v, ok := r.data[userData]
	return v, ok
}

// SSHKeys are the keys of spec.accessCredentials as the operator last wrote them (none
// before it first could).
func (r *Run) SSHKeys() (accesskeys.Keys, bool, error) {
	v, ok := r.data[accesskeys.SecretKey]
	if !ok {
		return nil, false, nil
	}
	k, err := accesskeys.Decode(v)
	return k, err == nil, err
}

// ErrNoRunSecret is WriteSSHKeys' answer when the VM's current run has no run Secret: none
// was needed when it started, or the run's own is not written yet.
var ErrNoRunSecret = errors.New("the VM's current run has no run Secret")

// WriteSSHKeys writes keys into the run Secret of vm's current run, if it differs: the
// operator's refresh while the VM runs; false says nothing was written.
func WriteSSHKeys(ctx context.Context, c client.Client, r client.Reader, ns string, vm *impv1.ImpVM, keys accesskeys.Keys) (bool, error) {
	var s corev1.Secret
	switch err := r.Get(ctx, types.NamespacedName{Namespace: ns, Name: Name(vm.UID)}, &s); {
	case apierrors.IsNotFound(err):
		return false, ErrNoRunSecret
	case err != nil:
		return false, fmt.Errorf("reading the run's Secret of %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	if s.Annotations[runAnno] != runOf(vm) {
		return false, ErrNoRunSecret
	}
	enc := keys.Encode()
	if string(s.Data[accesskeys.SecretKey]) == string(enc) {
		return false, nil
	}
	if s.Data == nil {
		s.Data = map[string][]byte{}
	}
	s.Data[accesskeys.SecretKey] = enc
	// An update of the version read (the operator may update, not patch, run Secrets): a
	// write of the run's meanwhile is a conflict, retried.
	if err := c.Update(ctx, &s); err != nil {
		return false, fmt.Errorf("writing the SSH keys into the run's Secret of %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	return true, nil
}
