package steps

import (
	"fmt"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/guestinit"
	"github.com/syscode-labs/imp/internal/runsecret"
)

// workload resolves what the guest runs: the image's entrypoint, cmd, env, working directory
// and user, with the ImpVM's overrides applied the way Kubernetes applies a container's:
// command replaces the entrypoint and drops the image's cmd; args replace the cmd; env is
// added to the image's, a name of the VM's winning.
func workload(vm *impv1.ImpVM, run *runsecret.Run, img *v1.Config) (guestinit.Config, error) {
	cfg := guestinit.Config{WorkingDir: img.WorkingDir, User: img.User, Hostname: vm.Name, Stdin: vm.Spec.Stdin, TTY: vm.Spec.TTY, Hold: holdsWorkload(vm)}
	if vm.Spec.Boot == impv1.BootOS {
		// The image's init runs the OS: no workload; the probes run beside it, and a failed
		// startup or liveness probe powers the OS off (docs/os.md).
		cfg.OS = true
		if ci := vm.Spec.CloudInit; ci != nil {
			cfg.CloudInit, cfg.CloudInitNetwork = true, ci.NetworkData != ""
		}
		probes, err := probes(vm)
		cfg.Probes = probes
		return cfg, err
	}
	w := vm.Workload() // a copy of a template runs its template's
	switch {
	case len(w.Command) > 0:
		cfg.Argv = append(append([]string{}, w.Command...), w.Args...)
	case len(w.Args) > 0:
		cfg.Argv = append(append([]string{}, img.Entrypoint...), w.Args...)
	default:
		cfg.Argv = append(append([]string{}, img.Entrypoint...), img.Cmd...)
	}
	if len(cfg.Argv) == 0 {
		return cfg, fmt.Errorf("the image has no entrypoint or cmd and the VM gives no command")
	}
	probes, err := probes(vm)
	if err != nil {
		return cfg, err
	}
	cfg.Probes = probes
	if w.WorkingDir != "" {
		cfg.WorkingDir = w.WorkingDir
	}
	env := map[string]int{}
	for _, e := range img.Env {
		name, _, _ := cut(e)
		env[name] = len(cfg.Env)
		cfg.Env = append(cfg.Env, e)
	}
	for i, e := range vm.Spec.Env {
		value := e.Value
		if e.ValueFrom != nil {
			v, ok := run.Env(i)
			if !ok {
				return cfg, fmt.Errorf("env %s: no value in the run's Secret", e.Name)
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

// holdsWorkload is true for a guest that readies everything but its workload and waits for a
// restore to start it: a template's VM the operator marked (snapshotWhen.beforeWorkload),
// and a warm pool's member restored from such a snapshot (its claim starts the workload). The
// mark counts only on a VM an ImpVMTemplate controls: a tenant's own VM that sets it would
// only wait for ever, but is not read as a template's.
func holdsWorkload(vm *impv1.ImpVM) bool {
	if impv1.WarmPoolOf(vm) != "" {
		return vm.Status.Template != nil && vm.Status.Template.BeforeWorkload
	}
	ref := metav1.GetControllerOfNoCopy(vm)
	return vm.Annotations[impv1.HoldWorkloadAnnotation] == "true" && vm.Labels[impv1.TemplateLabel] != "" &&
		ref != nil && ref.Kind == "ImpVMTemplate" && ref.APIVersion == impv1.GroupVersion.String()
}

func cut(e string) (string, string, bool) {
	for i := 0; i < len(e); i++ {
		if e[i] == '=' {
			return e[:i], e[i+1:], true
		}
	}
	return e, "", false
}
