package main

import (
	"context"
	"errors"
	"fmt"
	stdlog "log"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"github.com/syscode-labs/imp/internal/agentcsr"
	"github.com/syscode-labs/imp/internal/controller/idle"
	"github.com/syscode-labs/imp/internal/pki"
	"github.com/syscode-labs/imp/internal/subresources"
)

// subresourceFlags configure the aggregated API server of the ImpVM subresources.
type subresourceFlags struct {
	addr, namespace, caNamespace, service string
	apiService                            string
	agentPort                             int
	maxStreamsPerUser, maxStreamsPerVM    int
}

// setup adds the access certificates' rotator, the agents' certificate signer and the
// subresource server to mgr. Every replica serves: the API server picks any endpoint of the
// Service.
func (f subresourceFlags) setup(ctx context.Context, mgr ctrl.Manager, log logr.Logger) error {
	if f.namespace == "" {
		return errors.New("--subresources-namespace (or $POD_NAMESPACE) is required with --subresources-bind-address")
	}
	if f.caNamespace == "" {
		f.caNamespace = f.namespace + "-access"
	}
	rot := &pki.Rotator{Client: mgr.GetClient(), Reader: mgr.GetAPIReader(), Namespace: f.namespace, CANamespace: f.caNamespace, Service: f.service,
		APIService: f.apiService, Clock: clock.RealClock{}, Log: log.WithName("certificates")}
	// The agents' certificates, each for its own node, signed with the access CA.
	signer := &agentcsr.Reconciler{Client: mgr.GetClient(), CA: rot.CA, AgentUser: "system:serviceaccount:" + f.namespace + ":imp-agent", Clock: clock.RealClock{}}
	if err := signer.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the agents' certificate signer: %w", err)
	}
	fp := &subresources.FrontProxy{}
	srv := &subresources.Server{Reader: mgr.GetClient(), FrontProxy: fp, AgentTLS: rot.AgentClientTLS(), AgentPort: f.agentPort, Log: log,
		MaxStreamsPerUser: f.maxStreamsPerUser, MaxStreamsPerVM: f.maxStreamsPerVM,
		Waker: idle.Waker{Client: mgr.GetClient(), Recorder: mgr.GetEventRecorder("imp-operator")}}
	return errors.Join(mgr.Add(rot), mgr.Add(nonLeader(func(ctx context.Context) error {
		// The front proxy's identity, at start and every 5 minutes (the API server's CA
		// rotates rarely).
		go func() {
			for {
				if err := fp.Load(ctx, mgr.GetAPIReader()); err != nil {
					log.Error(err, "loading the API server's front-proxy identity")
				}
				select {
				case <-ctx.Done():
					return
				case <-time.After(5 * time.Minute):
				}
			}
		}()
		l, err := net.Listen("tcp", f.addr)
		if err != nil {
			return fmt.Errorf("listening on %s for the subresource server: %w", f.addr, err)
		}
		// The server's own errors (the API server's handshakes before the APIService's
		// caBundle names the CA, clients that go) at debug level.
		errLog := stdlog.New(logWriter{log.V(1)}, "", 0)
		hs := &http.Server{Handler: srv, TLSConfig: subresources.TLSConfig(rot.ServingCertificate), ReadHeaderTimeout: 10 * time.Second, ErrorLog: errLog}
		go func() {
			<-ctx.Done()
			_ = hs.Close()
		}()
		if err := hs.ServeTLS(l, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	})))
}

// nonLeader is a Runnable every replica runs.
type nonLeader manager.RunnableFunc

func (n nonLeader) Start(ctx context.Context) error { return n(ctx) }
func (nonLeader) NeedLeaderElection() bool          { return false }

// logWriter writes net/http's log lines to a logr.Logger.
type logWriter struct{ log logr.Logger }

func (w logWriter) Write(p []byte) (int, error) {
	w.log.Info(strings.TrimSpace(string(p)))
	return len(p), nil
}
