package agent

import (
	"context"
	"fmt"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// workload resolves what the guest runs: the image's entrypoint, cmd, env, working directory
// and user, with the ImpVM's overrides applied the way Kubernetes applies a container's:
// command replaces the entrypoint and drops the image's cmd; args replace the cmd; env is
// added to the image's, a name of the VM's winning.
func workload(ctx context.Context, r client.Reader, vm *impv1.ImpVM, img *v1.Config) (guestinit.Config, error) {
	cfg := guestinit.Config{WorkingDir: img.WorkingDir, User: img.User, Hostname: vm.Name}
	switch {
	case len(vm.Spec.Command) > 0:
		cfg.Argv = append(append([]string{}, vm.Spec.Command...), vm.Spec.Args...)
	case len(vm.Spec.Args) > 0:
		cfg.Argv = append(append([]string{}, img.Entrypoint...), vm.Spec.Args...)
	default:
		cfg.Argv = append(append([]string{}, img.Entrypoint...), img.Cmd...)
	}
	if len(cfg.Argv) == 0 {
		return cfg, fmt.Errorf("the image has no entrypoint or cmd and the VM gives no command")
	}
	if vm.Spec.WorkingDir != "" {
		cfg.WorkingDir = vm.Spec.WorkingDir
	}
	env := map[string]int{}
	for _, e := range img.Env {
		name, _, _ := cut(e)
		env[name] = len(cfg.Env)
		cfg.Env = append(cfg.Env, e)
	}
	for _, e := range vm.Spec.Env {
		value := e.Value
		if src := e.ValueFrom; src != nil {
			v, err := envFrom(ctx, r, vm.Namespace, src)
			if err != nil {
				return cfg, fmt.Errorf("env %s: %w", e.Name, err)
			}
			value = v
		}
		kv := e.Name + "=" + value
		if i, ok := env[e.Name]; ok {
			cfg.Env[i] = kv
		} else {
			env[e.Name] = len(cfg.Env)
			cfg.Env = append(cfg.Env, kv)
		}
	}
	return cfg, nil
}

func cut(e string) (string, string, bool) {
	for i := 0; i < len(e); i++ {
		if e[i] == '=' {
			return e[:i], e[i+1:], true
		}
	}
	return e, "", false
}

func envFrom(ctx context.Context, r client.Reader, ns string, src *impv1.EnvVarSource) (string, error) {
	switch {
	case src.SecretKeyRef != nil:
		ref := src.SecretKeyRef
		var s corev1.Secret
		if err := r.Get(ctx, types.NamespacedName{Namespace: ns, Name: ref.Name}, &s); err != nil {
			return "", fmt.Errorf("reading Secret %s: %w", ref.Name, err)
		}
		v, ok := s.Data[ref.Key]
		if !ok {
			return "", fmt.Errorf("Secret %s has no key %s", ref.Name, ref.Key)
		}
		return string(v), nil
	case src.ConfigMapKeyRef != nil:
		ref := src.ConfigMapKeyRef
		var cm corev1.ConfigMap
		if err := r.Get(ctx, types.NamespacedName{Namespace: ns, Name: ref.Name}, &cm); err != nil {
			return "", fmt.Errorf("reading ConfigMap %s: %w", ref.Name, err)
		}
		v, ok := cm.Data[ref.Key]
		if !ok {
			return "", fmt.Errorf("ConfigMap %s has no key %s", ref.Name, ref.Key)
		}
		return v, nil
	}
	return "", fmt.Errorf("valueFrom names no source")
}
