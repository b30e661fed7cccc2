// Package subresources is IMP's aggregated API server: it serves the ImpVM subresources
// console, exec, portforward and log under the API group subresources.imp.dev, which the
// Kubernetes API server proxies to it through an APIService.
//
// The Kubernetes API server authenticates the user, authorizes the request (RBAC on, for
// example, impvms/exec in the VM's namespace) and audits it; it then calls this server with
// its front-proxy client certificate and the user in X-Remote-User. This server serves that
// caller only (the requestheader CA and allowed names the API server publishes in
// kube-system/extension-apiserver-authentication), finds the VM's node, and proxies the
// request, streams and all, to that node's agent over mutually authenticated TLS
// (internal/agent/access).
package subresources

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/proxy"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/access"
	"github.com/syscode-labs/imp/internal/pki"
	"github.com/syscode-labs/imp/internal/streamcap"
)

// Group and Version of the subresources' API.
const (
	Group   = "subresources.imp.dev"
	Version = "v1alpha1"
)

// Subresources are the ImpVM subresources served, as the agent's endpoint names them.
var Subresources = []string{"console", "exec", "portforward", "log", "stats"}

// AgentServerName is the name the agents' serving certificate carries.
const AgentServerName = "imp-agent"

// The VMs and their nodes, and the API server's front-proxy identity in
// kube-system/extension-apiserver-authentication.
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=configmaps,verbs=get

// Server is the aggregated API server's handler.
type Server struct {
	// Reader reads ImpVMs and Nodes (the operator's cache).
	Reader client.Reader
	// FrontProxy says who may call: the API server's front proxy.
	FrontProxy *FrontProxy
	// AgentTLS is the client side of the agents' mutual TLS; its ServerName is set per node, to
	// the name the node's agent's certificate must carry (pki.AgentDNSName).
	AgentTLS *tls.Config
	// AgentPort is where agents serve their access endpoint.
	AgentPort int
	Log       logr.Logger
	// Clock is the real one when nil.
	Clock clock.PassiveClock
	// Waker wakes an idle-suspended VM (spec.idle) that a session is asked of: an exec, the
	// console or a port-forward waits (up to WakeTimeout, default 60s) for it to run again,
	// then attaches (a log, which the view role may read, never wakes it). Nil: not woken.
	Waker       Waker
	WakeTimeout time.Duration
	// MaxStreamsPerUser and MaxStreamsPerVM bound the requests (streams: exec, port-forward,
	// console, a followed log) open at once for one user and to one VM, through this server;
	// past them a request is refused 429. Defaults: DefaultMaxStreamsPerUser, PerVM.
	MaxStreamsPerUser, MaxStreamsPerVM int

	capsOnce       sync.Once
	perUser, perVM *streamcap.Limiter

	mu     sync.Mutex
	trs    map[string]*nodeTransport // by node
	pruned time.Time
}

// Waker wakes idle-suspended VMs (idle.Waker).
type Waker interface {
	// Wake deletes vm's suspension when its reason is Idle, and says whether it was.
	Wake(ctx context.Context, vm *impv1.ImpVM, user string) (bool, error)
}

// The default bounds of streams open at once through one server.
const (
	DefaultMaxStreamsPerUser = 64
	DefaultMaxStreamsPerVM   = 32
)

// acquire counts a stream of user to the VM key, or says why not.
func (s *Server) acquire(user string, key types.NamespacedName) (func(), error) {
	s.capsOnce.Do(func() {
		s.perUser = streamcap.New(cmp.Or(s.MaxStreamsPerUser, DefaultMaxStreamsPerUser), "user")
		s.perVM = streamcap.New(cmp.Or(s.MaxStreamsPerVM, DefaultMaxStreamsPerVM), "ImpVM")
	})
	releaseUser, err := s.perUser.Acquire(user)
	if err != nil {
		return nil, err
	}
	releaseVM, err := s.perVM.Acquire(key.String())
	if err != nil {
		releaseUser()
		return nil, err
	}
	return func() { releaseVM(); releaseUser() }, nil
}

// nodeTransport is a node's transport and when a request last took it.
type nodeTransport struct {
	*http.Transport
	used time.Time
}

// agentIdleTimeout closes a connection to an agent that has carried nothing for that long; a
// node's transport unused for longer holds none and is dropped, so that nodes come and gone
// leave nothing behind.
const agentIdleTimeout = 90 * time.Second

// ServeHTTP serves discovery and the subresources to the front proxy and to nobody else.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	user, err := s.FrontProxy.Authenticate(r)
	if err != nil {
		writeStatus(w, apierrors.NewUnauthorized(err.Error()))
		return
	}
	base := "/apis/" + Group + "/" + Version
	switch p := r.URL.Path; {
	case p == "/apis":
		writeJSON(w, &metav1.APIGroupList{TypeMeta: metav1.TypeMeta{Kind: "APIGroupList", APIVersion: "v1"}, Groups: []metav1.APIGroup{apiGroup()}})
	case p == "/apis/"+Group:
		g := apiGroup()
		g.TypeMeta = metav1.TypeMeta{Kind: "APIGroup", APIVersion: "v1"}
		writeJSON(w, &g)
	case p == base:
		writeJSON(w, apiResources())
	case strings.HasPrefix(p, base+"/namespaces/"):
		s.subresource(w, r, user, strings.Split(strings.TrimPrefix(p, base+"/namespaces/"), "/"))
	default:
		writeStatus(w, apierrors.NewNotFound(metav1.SchemeGroupVersion.WithResource("").GroupResource(), p))
	}
}

func apiGroup() metav1.APIGroup {
	gv := metav1.GroupVersionForDiscovery{GroupVersion: Group + "/" + Version, Version: Version}
	return metav1.APIGroup{Name: Group, Versions: []metav1.GroupVersionForDiscovery{gv}, PreferredVersion: gv}
}

func apiResources() *metav1.APIResourceList {
	l := &metav1.APIResourceList{TypeMeta: metav1.TypeMeta{Kind: "APIResourceList", APIVersion: "v1"}, GroupVersion: Group + "/" + Version}
	for _, sub := range Subresources {
		verbs := metav1.Verbs{"get", "create"} // a WebSocket upgrade is a GET, SPDY's a POST
		if readOnly(sub) {
			verbs = metav1.Verbs{"get"}
		}
		l.APIResources = append(l.APIResources, metav1.APIResource{Name: "impvms/" + sub, Namespaced: true, Kind: "ImpVM", Verbs: verbs})
	}
	return l
}

// subresource proxies namespaces/NS/impvms/NAME/SUB to the VM's agent.
func (s *Server) subresource(w http.ResponseWriter, r *http.Request, user string, parts []string) {
	gr := impv1.GroupVersion.WithResource("impvms").GroupResource()
	if len(parts) != 4 || parts[1] != "impvms" || !slices.Contains(Subresources, parts[3]) {
		writeStatus(w, apierrors.NewNotFound(gr, strings.Join(parts, "/")))
		return
	}
	ns, name, sub := parts[0], parts[2], parts[3]
	if len(validation.IsDNS1123Label(ns)) > 0 || len(validation.IsDNS1123Subdomain(name)) > 0 {
		writeStatus(w, apierrors.NewBadRequest("invalid namespace or name"))
		return
	}
	if readOnly(sub) && r.Method != http.MethodGet {
		writeStatus(w, apierrors.NewMethodNotSupported(gr, r.Method))
		return
	}
	log := s.Log.WithValues("vm", types.NamespacedName{Namespace: ns, Name: name}, "subresource", sub, "user", user)
	release, err := s.acquire(user, types.NamespacedName{Namespace: ns, Name: name})
	if err != nil {
		log.Info("refused", "reason", err.Error())
		writeStatus(w, apierrors.NewTooManyRequests(err.Error(), 1))
		return
	}
	defer release()
	ctx := r.Context()
	vm := &impv1.ImpVM{}
	if err := s.Reader.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, vm); err != nil {
		writeStatus(w, statusFor(err))
		return
	}
	if vm.Status.NodeName == "" {
		writeStatus(w, apierrors.NewConflict(gr, name, fmt.Errorf("the VM is not placed on a node (phase %q)", vm.Status.Phase)))
		return
	}
	if pool := impv1.WarmPoolOf(vm); pool != "" && !readOnly(sub) {
		// An idle member is the pool's, to be handed to a claim as it was made: nothing is run
		// or typed in it before then (its console log may be read).
		writeStatus(w, apierrors.NewConflict(gr, name, fmt.Errorf("the VM is an idle member of ImpWarmPool %s: it takes no %s until it is handed to a claim (kubectl imp claim %s)", pool, sub, pool)))
		return
	}
	// Only what may run something in the guest (exec, console, port-forward) wakes it: reading
	// its log or its figures, which the view role may, never does.
	if sp := vm.Status.Suspension; sp != nil && sp.Reason == impv1.SuspendReasonIdle && s.Waker != nil && !readOnly(sub) {
		log.Info("waking the idle VM for a session")
		if vm, err = s.wake(ctx, vm, user); err != nil {
			writeStatus(w, apierrors.NewServiceUnavailable(err.Error()))
			return
		}
	}
	addr, err := s.agentAddress(ctx, vm.Status.NodeName)
	if err != nil {
		writeStatus(w, apierrors.NewServiceUnavailable(err.Error()))
		return
	}
	target := &url.URL{Scheme: "https", Host: addr,
		Path:     "/vms/" + ns + "/" + name + "/" + string(vm.HostUID()) + "/" + sub,
		RawQuery: r.URL.RawQuery}
	log.Info("proxying to the agent", "node", vm.Status.NodeName)
	// The front proxy's identity headers and credentials stay here: the agent learns the user
	// only from UserHeader, which it logs.
	for k := range r.Header {
		if strings.HasPrefix(strings.ToLower(k), "x-remote-") || strings.EqualFold(k, "Authorization") {
			r.Header.Del(k)
		}
	}
	r.Header.Set(access.UserHeader, user)
	// The API server's own proxy for streams (SPDY and WebSocket upgrades included).
	h := proxy.NewUpgradeAwareHandler(target, s.transport(vm.Status.NodeName), false, false, responder{log})
	h.FlushInterval = -1 // a log follows
	h.ServeHTTP(w, r)
}

// readOnly says whether sub only reads what the node has of the VM (its console log, its
// figures): GET only, granted to the view role, and it never wakes an idle VM nor is refused
// an idle warm pool member.
func readOnly(sub string) bool { return sub == "log" || sub == "stats" }

// wake wakes the idle-suspended vm and waits until it runs again, or WakeTimeout passed.
func (s *Server) wake(ctx context.Context, vm *impv1.ImpVM, user string) (*impv1.ImpVM, error) {
	if _, err := s.Waker.Wake(ctx, vm, user); err != nil {
		return nil, err
	}
	timeout := s.WakeTimeout
	if timeout <= 0 {
		timeout = time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	key := client.ObjectKeyFromObject(vm)
	for {
		cur := &impv1.ImpVM{}
		if err := s.Reader.Get(ctx, key, cur); err != nil {
			return nil, err
		}
		if rt := cur.Status.Runtime; cur.Status.Suspension == nil && rt != nil && rt.State == impv1.RuntimeRunning && cur.Status.NodeName != "" {
			return cur, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("the VM was suspended because it was idle, and did not run again within %v of being woken", timeout)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// transport reaches node's agent, which must present that node's certificate: another node's
// agent, which has its own node's only, is refused.
func (s *Server) transport(node string) *http.Transport {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if now.Sub(s.pruned) > agentIdleTimeout {
		for n, tr := range s.trs {
			if now.Sub(tr.used) > agentIdleTimeout {
				tr.CloseIdleConnections() // none, normally; streams in flight keep theirs
				delete(s.trs, n)
			}
		}
		s.pruned = now
	}
	if tr := s.trs[node]; tr != nil {
		tr.used = now
		return tr.Transport
	}
	if s.trs == nil {
		s.trs = map[string]*nodeTransport{}
	}
	cfg := s.AgentTLS.Clone()
	cfg.ServerName = pki.AgentDNSName(node)
	tr := &http.Transport{
		TLSClientConfig:     cfg,
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout: 10 * time.Second,
		MaxIdleConnsPerHost: 4,
		IdleConnTimeout:     agentIdleTimeout,
	}
	s.trs[node] = &nodeTransport{Transport: tr, used: now}
	return tr
}

// transports is the number of nodes whose transport is kept.
func (s *Server) transports() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.trs)
}

func (s *Server) now() time.Time {
	if s.Clock == nil {
		return time.Now()
	}
	return s.Clock.Now()
}

// responder reports a failure to reach the agent.
type responder struct{ log logr.Logger }

func (r responder) Error(w http.ResponseWriter, _ *http.Request, err error) {
	r.log.Info("reaching the agent", "error", err.Error())
	writeStatus(w, apierrors.NewServiceUnavailable("reaching the VM's node agent: "+err.Error()))
}

// agentAddress is the host:port of node's access endpoint: its InternalIP, else ExternalIP.
func (s *Server) agentAddress(ctx context.Context, node string) (string, error) {
	n := &corev1.Node{}
	if err := s.Reader.Get(ctx, types.NamespacedName{Name: node}, n); err != nil {
		return "", fmt.Errorf("reading node %s: %w", node, err)
	}
	for _, t := range []corev1.NodeAddressType{corev1.NodeInternalIP, corev1.NodeExternalIP} {
		for _, a := range n.Status.Addresses {
			if a.Type == t && a.Address != "" {
				return net.JoinHostPort(a.Address, strconv.Itoa(s.AgentPort)), nil
			}
		}
	}
	return "", fmt.Errorf("node %s has no address", node)
}

func statusFor(err error) *apierrors.StatusError {
	var se *apierrors.StatusError
	if errors.As(err, &se) {
		return se
	}
	return apierrors.NewInternalError(err)
}

func writeStatus(w http.ResponseWriter, err *apierrors.StatusError) {
	st := err.ErrStatus
	st.TypeMeta = metav1.TypeMeta{Kind: "Status", APIVersion: "v1"}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(int(st.Code))
	_ = json.NewEncoder(w).Encode(&st)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// FrontProxy is the API server's front-proxy identity: the CA of its client certificate, the
// names that certificate may carry, and the header naming the user, as the API server
// publishes them in kube-system/extension-apiserver-authentication.
type FrontProxy struct {
	mu           sync.RWMutex
	pool         *x509.CertPool
	allowedNames []string
	userHeaders  []string
}

// Authenticate returns the user a request of the front proxy is for, or why it is refused.
func (f *FrontProxy) Authenticate(r *http.Request) (string, error) {
	f.mu.RLock()
	pool, names, headers := f.pool, f.allowedNames, f.userHeaders
	f.mu.RUnlock()
	if pool == nil {
		return "", errors.New("the API server's front-proxy CA is not known yet")
	}
	if r.TLS == nil || len(r.TLS.PeerCertificates) == 0 {
		return "", errors.New("no client certificate")
	}
	certs := r.TLS.PeerCertificates
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	if _, err := certs[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		return "", fmt.Errorf("client certificate: %w", err)
	}
	if len(names) > 0 && !slices.Contains(names, certs[0].Subject.CommonName) {
		return "", fmt.Errorf("client certificate %q is not the front proxy's", certs[0].Subject.CommonName)
	}
	for _, h := range headers {
		if u := r.Header.Get(h); u != "" {
			return u, nil
		}
	}
	return "", errors.New("no user")
}

// Load reads the front proxy's identity from the API server's ConfigMap.
func (f *FrontProxy) Load(ctx context.Context, c client.Reader) error {
	cm := &corev1.ConfigMap{}
	if err := c.Get(ctx, types.NamespacedName{Namespace: "kube-system", Name: "extension-apiserver-authentication"}, cm); err != nil {
		return fmt.Errorf("reading the API server's front-proxy configuration: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM([]byte(cm.Data["requestheader-client-ca-file"])) {
		return errors.New("kube-system/extension-apiserver-authentication has no requestheader-client-ca-file: the API server has no front proxy (--requestheader-client-ca-file)")
	}
	var names, headers []string
	if s := cm.Data["requestheader-allowed-names"]; s != "" {
		if err := json.Unmarshal([]byte(s), &names); err != nil {
			return fmt.Errorf("requestheader-allowed-names: %w", err)
		}
	}
	if s := cm.Data["requestheader-username-headers"]; s != "" {
		if err := json.Unmarshal([]byte(s), &headers); err != nil {
			return fmt.Errorf("requestheader-username-headers: %w", err)
		}
	}
	if len(headers) == 0 {
		headers = []string{"X-Remote-User"}
	}
	f.mu.Lock()
	f.pool, f.allowedNames, f.userHeaders = pool, names, headers
	f.mu.Unlock()
	return nil
}

// TLSConfig is the server side of the front proxy's TLS: serving with the certificate files
// (read again when they change) and asking for a client certificate, which Authenticate
// checks.
func TLSConfig(serving func() (*tls.Certificate, error)) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		ClientAuth: tls.RequestClientCert,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return serving()
		},
		NextProtos: []string{"http/1.1"}, // streams upgrade over HTTP/1.1
	}
}
