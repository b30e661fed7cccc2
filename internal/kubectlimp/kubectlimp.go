// Package kubectlimp is the kubectl plugin `kubectl imp`: the verbs a VM user expects, on
// ImpVMs, with kubectl's flags (-n, --context, --kubeconfig, -o json|yaml).
package kubectlimp

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/duration"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	impscheme "github.com/syscode-labs/imp/internal/scheme"
)

// Annotations the plugin sets on ImpVMs.
const (
	// StoppedFromAnnotation remembers the runStrategy `stop` replaced, for `start`.
	StoppedFromAnnotation = "imp.dev/run-strategy-before-stop"
)

type options struct {
	flags    *genericclioptions.ConfigFlags
	stateDir string
	bytes    int64
	out      io.Writer
	errOut   io.Writer
	in       io.Reader
	output   string
	allNS    bool
	node     string
	all      bool
	message  string
	wait     bool
	env      []string
	// timeout bounds a command (a minute when 0).
	timeout time.Duration
}

// NewCommand is `kubectl imp` writing to out.
func NewCommand(in io.Reader, out, errOut io.Writer) *cobra.Command {
	o := &options{flags: genericclioptions.NewConfigFlags(true), in: in, out: out, errOut: errOut}
	root := &cobra.Command{
		Use:   "kubectl-imp",
		Short: "Act on IMP microVMs",
		Long: `kubectl imp acts on ImpVMs the way a VM user expects: list, status, logs, exec,
port-forward, console, top, suspend, resume, snapshot, stop, start, restart and migrate; drain and undrain
evacuate a node; rollout status, history and undo follow and reverse the updates of ImpVMPools;
claim takes a VM of an ImpWarmPool. Suspending creates an
ImpVMSuspension of the VM's name (RBAC grants it apart from editing VMs; the audit log says who);
resuming deletes it. logs, exec, port-forward, console and top are the VM's subresources in the API
group subresources.imp.dev, which RBAC grants per namespace (docs/access.md).`,
		SilenceUsage: true,
	}
	root.SetOut(out)
	root.SetErr(errOut)
	o.flags.AddFlags(root.PersistentFlags())
	root.PersistentFlags().StringVarP(&o.output, "output", "o", "", "output format: json or yaml")

	list := &cobra.Command{Use: "list", Short: "List ImpVMs", Args: cobra.NoArgs, RunE: o.run(o.list)}
	list.Flags().BoolVarP(&o.allNS, "all-namespaces", "A", false, "list VMs of every namespace")
	suspend := &cobra.Command{Use: "suspend NAME", Short: "Suspend a VM: its memory goes to its node's disk, its VMM stops", Args: cobra.ExactArgs(1), RunE: o.run(o.suspend)}
	suspend.Flags().StringVar(&o.message, "message", "", "why (recorded on the ImpVMSuspension)")
	resume := &cobra.Command{Use: "resume [NAME | --node NODE --all]", Short: "Resume a suspended VM, or every VM the pressure lifecycle suspended on a node",
		Args: cobra.MaximumNArgs(1), RunE: o.run(o.resume)}
	resume.Flags().StringVar(&o.node, "node", "", "with --all: the node whose VMs to resume")
	resume.Flags().BoolVar(&o.all, "all", false, "with --node: resume every VM the pressure lifecycle suspended there")
	snapshot := &cobra.Command{Use: "snapshot VM [NAME]", Short: "Snapshot a VM (an ImpVMSnapshot: named NAME, or after the VM and the time)",
		Args: cobra.RangeArgs(1, 2), RunE: o.run(o.snapshot)}
	snapshot.Flags().BoolVar(&o.wait, "wait", false, "wait until the snapshot is ready (or failed)")
	claim := &cobra.Command{Use: "claim POOL [NAME] [--env KEY=VALUE...] [--wait]",
		Short: "Claim a VM of an ImpWarmPool: an ImpVM with warmPoolRef (named NAME, or after the pool), handed an idle member or restored",
		Args:  cobra.RangeArgs(1, 2), RunE: o.run(o.claim)}
	claim.Flags().BoolVar(&o.wait, "wait", false, "wait until the VM is Ready, and say how it started")
	claim.Flags().StringArrayVar(&o.env, "env", nil, "an environment variable of the claim, KEY=VALUE (repeatable)")
	a := &accessOptions{}
	logs := &cobra.Command{Use: "logs NAME [-f]", Short: "Print a VM's console log (its newest part), and follow it with -f", Args: cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			if o.stateDir != "" {
				return o.run(o.logs)(c, args)
			}
			return o.cmd(func(ctx context.Context, cfg *rest.Config, ns string, args []string) error {
				return o.logsThroughAPI(ctx, cfg, ns, args[0], a)
			})(c, args)
		}}
	logs.Flags().StringVar(&o.stateDir, "state-dir", "", "read the console from this agent state directory on this machine instead (an agent running on this machine)")
	logs.Flags().Int64Var(&o.bytes, "limit-bytes", 256<<10, "print at most this many bytes, the newest")
	logs.Flags().BoolVarP(&a.follow, "follow", "f", false, "follow the log until interrupted")
	logs.Flags().BoolVar(&a.raw, "raw", false, "print the guest's output as it is: escape sequences included (default: shown, not interpreted)")
	root.AddCommand(claim)
	root.AddCommand(list, logs,
		&cobra.Command{Use: "status NAME", Short: "Show a VM's state", Args: cobra.ExactArgs(1), RunE: o.run(o.status)},
		suspend, resume, snapshot,
		&cobra.Command{Use: "stop NAME", Short: "Stop a VM (runStrategy Halted); it keeps its disks", Args: cobra.ExactArgs(1), RunE: o.run(o.stop)},
		&cobra.Command{Use: "start NAME", Short: "Start a stopped VM (its runStrategy before stop)", Args: cobra.ExactArgs(1), RunE: o.run(o.start)},
		&cobra.Command{Use: "restart NAME", Short: "Restart a VM's workload (a new run on its node)", Args: cobra.ExactArgs(1), RunE: o.run(o.restart)},
	)
	root.AddCommand(o.rolloutCommand())
	root.AddCommand(o.migrateCommands()...)
	root.AddCommand(o.accessCommands(a)...)
	root.AddCommand(o.topCommand())
	return root
}

type verb func(ctx context.Context, c client.Client, ns string, args []string) error

func (o *options) run(v verb) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		cfg, err := o.flags.ToRESTConfig()
		if err != nil {
			return err
		}
		c, err := newClient(cfg)
		if err != nil {
			return err
		}
		ns, _, err := o.flags.ToRawKubeConfigLoader().Namespace()
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(cmd.Context(), cmp.Or(o.timeout, time.Minute))
		defer cancel()
		return v(ctx, c, ns, args)
	}
}

// newClient is a client of cfg's API server that knows IMP's kinds.
func newClient(cfg *rest.Config) (client.Client, error) {
	scheme, err := impscheme.New()
	if err != nil {
		return nil, err
	}
	return client.New(cfg, client.Options{Scheme: scheme})
}

// print writes obj as JSON or YAML when -o asks for it, and reports whether it did. Objects
// carry their kind and apiVersion, as kubectl prints them (a typed client's reads leave them
// empty).
func (o *options) print(obj any) (bool, error) {
	gv := impv1.GroupVersion.String()
	switch obj := obj.(type) {
	case *impv1.ImpVM:
		obj.APIVersion, obj.Kind = gv, "ImpVM"
	case *impv1.ImpVMList:
		obj.APIVersion, obj.Kind = gv, "ImpVMList"
		for i := range obj.Items {
			obj.Items[i].APIVersion, obj.Items[i].Kind = gv, "ImpVM"
		}
	}
	switch o.output {
	case "":
		return false, nil
	case "json":
		b, err := json.MarshalIndent(obj, "", "  ")
		if err != nil {
			return true, err
		}
		_, err = fmt.Fprintln(o.out, string(b))
		return true, err
	case "yaml":
		b, err := yaml.Marshal(obj)
		if err != nil {
			return true, err
		}
		_, err = o.out.Write(b)
		return true, err
	}
	return true, fmt.Errorf("--output %q: want json or yaml", o.output)
}

func (o *options) list(ctx context.Context, c client.Client, ns string, _ []string) error {
	var vms impv1.ImpVMList
	opts := []client.ListOption{}
	if !o.allNS {
		opts = append(opts, client.InNamespace(ns))
	}
	if err := c.List(ctx, &vms, opts...); err != nil {
		return err
	}
	if done, err := o.print(&vms); done {
		return err
	}
	sort.Slice(vms.Items, func(i, j int) bool {
		return vms.Items[i].Namespace+"/"+vms.Items[i].Name < vms.Items[j].Namespace+"/"+vms.Items[j].Name
	})
	w := tabwriter.NewWriter(o.out, 0, 4, 3, ' ', 0)
	fmt.Fprintln(w, "NAMESPACE\tNAME\tPHASE\tNODE\tIP\tSUSPENDED\tAGE")
	for _, vm := range vms.Items {
		susp := ""
		if sp := vm.Status.Suspension; sp != nil {
			susp = sp.Reason
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", vm.Namespace, vm.Name, vm.Status.Phase, dash(vm.Status.NodeName), dash(vm.Status.IP),
			dash(susp), duration.HumanDuration(time.Since(vm.CreationTimestamp.Time)))
	}
	return w.Flush()
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func (o *options) get(ctx context.Context, c client.Client, ns, name string) (*impv1.ImpVM, error) {
	vm := &impv1.ImpVM{}
	if err := c.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, vm); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("ImpVM %s not found in namespace %s", name, ns)
		}
		return nil, err
	}
	return vm, nil
}

func (o *options) status(ctx context.Context, c client.Client, ns string, args []string) error {
	vm, err := o.get(ctx, c, ns, args[0])
	if err != nil {
		return err
	}
	if done, err := o.print(vm); done {
		return err
	}
	st := vm.Status
	w := tabwriter.NewWriter(o.out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "Name:\t%s/%s\n", vm.Namespace, vm.Name)
	fmt.Fprintf(w, "Phase:\t%s\n", st.Phase)
	fmt.Fprintf(w, "Node:\t%s\n", dash(st.NodeName))
	fmt.Fprintf(w, "IP:\t%s\n", dash(st.IP))
	if r := st.Resources; r != nil {
		fmt.Fprintf(w, "Resources:\t%d vCPUs, %s memory, %s disk\n", r.VCPUs, r.Memory.String(), r.DiskSize.String())
	}
	if st.Image != "" {
		fmt.Fprintf(w, "Image:\t%s\n", st.Image)
	}
	if st.Start != "" {
		started := string(st.Start)
		if wm := st.Warm; wm != nil {
			started += fmt.Sprintf(" (member %s of impwarmpool/%s)", wm.Member, wm.Pool)
		}
		fmt.Fprintf(w, "Started:\t%s\n", started)
	}
	fmt.Fprintf(w, "Instance:\t%d (restarts %d)\n", st.Instance, st.RestartCount)
	if rt := st.Runtime; rt != nil {
		fmt.Fprintf(w, "Runtime:\t%s %s %s\n", rt.State, rt.Reason, rt.Message)
	}
	if sp := st.Suspension; sp != nil {
		since := "suspending"
		if sp.Since != nil {
			since = "since " + sp.Since.Format(time.RFC3339)
		}
		fmt.Fprintf(w, "Suspended:\t%s (%s) %s\n", sp.Reason, since, sp.Message)
	}
	if rt := st.Runtime; rt != nil && rt.RestoredFrom != "" {
		fmt.Fprintf(w, "Restored from:\timpvmsnapshot/%s\n", rt.RestoredFrom)
	}
	for _, cond := range st.Conditions {
		fmt.Fprintf(w, "Condition %s:\t%s %s: %s\n", cond.Type, cond.Status, cond.Reason, cond.Message)
	}
	if vm.Spec.NetworkRef != nil {
		if err := printPolicies(ctx, c, w, vm); err != nil {
			return err
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}
	return printSnapshots(ctx, c, o.out, ns, vm.Name)
}

func (o *options) suspend(ctx context.Context, c client.Client, ns string, args []string) error {
	vm, err := o.get(ctx, c, ns, args[0])
	if err != nil {
		return err
	}
	msg := o.message
	if msg == "" {
		msg = "suspended with kubectl imp"
	}
	s := &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: vm.Name,
		OwnerReferences: []metav1.OwnerReference{{APIVersion: impv1.GroupVersion.String(), Kind: "ImpVM", Name: vm.Name, UID: vm.UID}}},
		Spec: impv1.ImpVMSuspensionSpec{Reason: impv1.SuspendReasonUser, Message: msg}}
	if err := c.Create(ctx, s); err != nil {
		if apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("ImpVM %s is already suspended (or being suspended)", vm.Name)
		}
		return err
	}
	fmt.Fprintf(o.out, "impvm/%s suspending\n", vm.Name)
	return nil
}

func (o *options) resume(ctx context.Context, c client.Client, ns string, args []string) error {
	switch {
	case o.node != "" && o.all && len(args) == 0:
		return o.resumeNode(ctx, c)
	case o.node == "" && !o.all && len(args) == 1:
		return o.resumeOne(ctx, c, ns, args[0])
	}
	return errors.New("resume takes a VM's name, or --node NODE --all")
}

func (o *options) resumeOne(ctx context.Context, c client.Client, ns, name string) error {
	s := &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	if err := c.Delete(ctx, s); err != nil {
		if apierrors.IsNotFound(err) {
			return fmt.Errorf("ImpVM %s is not suspended", name)
		}
		return err
	}
	fmt.Fprintf(o.out, "impvm/%s resuming\n", name)
	return nil
}

// resumeNode resumes what the pressure lifecycle suspended on a node; VMs a person suspended
// stay suspended.
func (o *options) resumeNode(ctx context.Context, c client.Client) error {
	var vms impv1.ImpVMList
	if err := c.List(ctx, &vms, client.MatchingFields{"status.nodeName": o.node}); err != nil {
		return fmt.Errorf("listing the VMs of node %s: %w", o.node, err)
	}
	var susps impv1.ImpVMSuspensionList
	if err := c.List(ctx, &susps); err != nil {
		return fmt.Errorf("listing suspensions: %w", err)
	}
	pressure := map[types.NamespacedName]*impv1.ImpVMSuspension{}
	for i := range susps.Items {
		if s := &susps.Items[i]; s.Spec.Reason == impv1.SuspendReasonPressure {
			pressure[client.ObjectKeyFromObject(s)] = s
		}
	}
	n := 0
	for _, vm := range vms.Items {
		s, ok := pressure[client.ObjectKeyFromObject(&vm)]
		if !ok {
			continue
		}
		if err := c.Delete(ctx, s, client.Preconditions{UID: &s.UID}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
		fmt.Fprintf(o.out, "impvm/%s resuming (namespace %s)\n", vm.Name, vm.Namespace)
		n++
	}
	if n == 0 {
		fmt.Fprintf(o.out, "no VM suspended by the pressure lifecycle on node %s\n", o.node)
	}
	return nil
}

func (o *options) stop(ctx context.Context, c client.Client, ns string, args []string) error {
	vm, err := o.get(ctx, c, ns, args[0])
	if err != nil {
		return err
	}
	if vm.Spec.RunStrategy == impv1.RunStrategyHalted {
		return fmt.Errorf("ImpVM %s is already stopped", vm.Name)
	}
	orig := vm.DeepCopy()
	if vm.Annotations == nil {
		vm.Annotations = map[string]string{}
	}
	vm.Annotations[StoppedFromAnnotation] = string(vm.Spec.RunStrategy)
	vm.Spec.RunStrategy = impv1.RunStrategyHalted
	if err := c.Patch(ctx, vm, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return err
	}
	fmt.Fprintf(o.out, "impvm/%s stopping\n", vm.Name)
	return nil
}

func (o *options) start(ctx context.Context, c client.Client, ns string, args []string) error {
	vm, err := o.get(ctx, c, ns, args[0])
	if err != nil {
		return err
	}
	if vm.Spec.RunStrategy != impv1.RunStrategyHalted {
		return fmt.Errorf("ImpVM %s is not stopped (runStrategy %s)", vm.Name, vm.Spec.RunStrategy)
	}
	orig := vm.DeepCopy()
	rs := impv1.RunStrategy(vm.Annotations[StoppedFromAnnotation])
	if rs == "" || rs == impv1.RunStrategyHalted {
		rs = impv1.RunStrategyAlways
	}
	vm.Spec.RunStrategy = rs
	delete(vm.Annotations, StoppedFromAnnotation)
	if err := c.Patch(ctx, vm, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return err
	}
	fmt.Fprintf(o.out, "impvm/%s starting (runStrategy %s)\n", vm.Name, rs)
	return nil
}

func (o *options) restart(ctx context.Context, c client.Client, ns string, args []string) error {
	vm, err := o.get(ctx, c, ns, args[0])
	if err != nil {
		return err
	}
	if vm.Status.Phase != impv1.VMRunning {
		return fmt.Errorf("ImpVM %s is %s: only a running VM restarts", vm.Name, strings.ToLower(string(vm.Status.Phase)))
	}
	orig := vm.DeepCopy()
	if vm.Annotations == nil {
		vm.Annotations = map[string]string{}
	}
	vm.Annotations[impv1.RestartRequestedAnnotation] = time.Now().UTC().Format(time.RFC3339Nano)
	if err := c.Patch(ctx, vm, client.MergeFrom(orig)); err != nil {
		return err
	}
	fmt.Fprintf(o.out, "impvm/%s restarting\n", vm.Name)
	return nil
}

// logs prints the VM's console log from an agent's state directory on this machine
// (--state-dir: an agent running on this machine); otherwise logsThroughAPI reads it.
func (o *options) logs(ctx context.Context, c client.Client, ns string, args []string) error {
	vm, err := o.get(ctx, c, ns, args[0])
	if err != nil {
		return err
	}
	f, err := os.Open(filepath.Join(o.stateDir, "vms", string(vm.UID), "console.log"))
	if err != nil {
		return fmt.Errorf("reading the console of %s: %w", vm.Name, err)
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() > o.bytes {
		_, _ = f.Seek(fi.Size()-o.bytes, io.SeekStart)
	}
	_, err = io.Copy(&inert{w: o.out}, f)
	return err
}
