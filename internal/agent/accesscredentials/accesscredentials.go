// Package accesscredentials is the agent's side of a VM's SSH keys (spec.accessCredentials,
// docs/os.md "SSH keys"): when a running OS's status.accessCredentials says keys it has not
// given this run's guest, it reads them from the VM's run Secret (the operator wrote them there
// first) and gives them to the guest side over the session channel, which writes them into the
// users' authorized_keys. A user the OS does not have yet (one cloud-init makes) is asked for
// again until it has.
package accesscredentials

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/accesskeys"
	"github.com/syscode-labs/imp/internal/guestsession"
	"github.com/syscode-labs/imp/internal/runsecret"
)

// Reasons of the Events the giver records.
const (
	ReasonGiven   = "AccessCredentialsGiven"
	ReasonPending = "AccessCredentialsPending"
)

// Retry is how soon keys are given again to an OS that lacks some of their users, doubled at
// each further try up to MaxRetry.
const (
	Retry    = 3 * time.Second
	MaxRetry = time.Minute
)

// Timeout bounds a guest's answer: a guest that stalls holds one of the giver's workers this
// long, and no more.
const Timeout = 10 * time.Second

// Workers give keys to as many VMs at once.
const Workers = 4

// Sessions are the running VMs' session channels (the monitor's registry).
type Sessions interface {
	Session(key types.NamespacedName, uid types.UID) (*guestsession.Client, error)
}

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// Giver gives running OSes of its node their SSH keys, one VM per request.
type Giver struct {
	Client    client.Reader // the cache's VMs
	APIReader client.Reader // the run Secrets
	Namespace string        // of the run Secrets
	NodeName  string
	Sessions  Sessions
	Recorder  EventRecorder

	mu sync.Mutex
	// given is, per VM, the run and digest whose keys its guest has ("uid instance.run
	// digest"); pending, those whose guest lacks users, and how often it was asked.
	given   map[types.NamespacedName]string
	pending map[types.NamespacedName]tries
}

type tries struct {
	mark string
	n    int
}

// Reconcile gives the VM's guest the keys of its status' digest, once per run and digest.
func (g *Giver) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	vm := &impv1.ImpVM{}
	if err := g.Client.Get(ctx, req.NamespacedName, vm); err != nil {
		if apierrors.IsNotFound(err) {
			g.mu.Lock()
			delete(g.given, req.NamespacedName)
			delete(g.pending, req.NamespacedName)
			g.mu.Unlock()
		}
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	st, rt := &vm.Status, vm.Status.Runtime
	if st.NodeName != g.NodeName || st.AccessCredentials == nil || st.AccessCredentials.Digest == "" || rt == nil ||
		rt.Instance != st.Instance || rt.Run != st.RestartCount || rt.State != impv1.RuntimeRunning || !rt.GuestReady {
		return ctrl.Result{}, nil // not this node's, no keys read yet, or no guest side to give them to
	}
	digest := st.AccessCredentials.Digest
	mark := fmt.Sprintf("%s %d.%d %s", vm.UID, rt.Instance, rt.Run, digest)
	g.mu.Lock()
	done := g.given[req.NamespacedName] == mark
	g.mu.Unlock()
	if done {
		return ctrl.Result{}, nil
	}
	keys := accesskeys.None // no credentials named any more: the users given keys lose them
	if digest != accesskeys.None.Digest() {
		run, err := runsecret.Read(ctx, g.APIReader, g.Namespace, vm)
		if err != nil {
			return ctrl.Result{}, fmt.Errorf("the SSH keys of %s/%s: %w", vm.Namespace, vm.Name, err)
		}
		k, ok, err := run.SSHKeys()
		if err != nil {
			return ctrl.Result{}, err
		}
		if !ok || k.Digest() != digest {
			// The operator writes the run Secret before the status, and the status again at
			// its next read when the Secret changed meanwhile: a digest the Secret does not
			// hold is read again, with backoff.
			return ctrl.Result{}, fmt.Errorf("the SSH keys of %s/%s: the run's Secret holds no keys of digest %.12s yet", vm.Namespace, vm.Name, digest)
		}
		keys = k
	}
	s, err := g.Sessions.Session(req.NamespacedName, vm.HostUID())
	if err != nil {
		return ctrl.Result{}, fmt.Errorf("the SSH keys of %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	ctx, cancel := context.WithTimeout(ctx, Timeout)
	defer cancel()
	pending, err := s.Keys(ctx, guestsession.AuthorizedKeys(keys))
	if err != nil {
		return ctrl.Result{}, fmt.Errorf("the SSH keys of %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	g.mu.Lock()
	if g.given == nil {
		g.given, g.pending = map[types.NamespacedName]string{}, map[types.NamespacedName]tries{}
	}
	p := g.pending[req.NamespacedName]
	if p.mark != mark {
		p = tries{mark: mark}
	}
	if len(pending) == 0 {
		g.given[req.NamespacedName] = mark
		delete(g.pending, req.NamespacedName)
	} else {
		p.n++
		g.pending[req.NamespacedName] = p
	}
	g.mu.Unlock()
	if len(pending) > 0 {
		if p.n == 1 {
			g.Recorder.Eventf(vm, nil, "Normal", ReasonPending, "GiveKeys", "the OS has no user %s yet: its keys are given once it has", strings.Join(pending, ", "))
		}
		return ctrl.Result{RequeueAfter: min(Retry<<min(p.n-1, 8), MaxRetry)}, nil
	}
	g.Recorder.Eventf(vm, nil, "Normal", ReasonGiven, "GiveKeys", "the OS's users have the SSH keys of digest %.12s", digest)
	return ctrl.Result{}, nil
}

// SetupWithManager registers the giver for VMs with a digest of keys.
func (g *Giver) SetupWithManager(mgr ctrl.Manager) error {
	concerned := predicate.NewPredicateFuncs(func(o client.Object) bool {
		return o.(*impv1.ImpVM).Status.AccessCredentials != nil
	})
	return ctrl.NewControllerManagedBy(mgr).
		Named("imp-agent-accesscredentials").
		For(&impv1.ImpVM{}, builder.WithPredicates(concerned)).
		WithOptions(controller.Options{MaxConcurrentReconciles: Workers}).
		Complete(g)
}
