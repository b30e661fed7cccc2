// Package agentcsr is the operator's signer of the agents' access endpoint certificates
// (pki.SignerName): each agent asks, through the certificates API, for a certificate for its
// own node, with a key that never leaves the node; this reconciler approves and signs exactly
// that, and denies the rest. Which node an agent is on comes from its token, bound to its
// imp-runtime pod (the claim authentication.kubernetes.io/node-name), never from the request.
package agentcsr

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"slices"
	"time"

	certv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	"github.com/syscode-labs/imp/internal/pki"
)

// +kubebuilder:rbac:groups=certificates.k8s.io,resources=certificatesigningrequests,verbs=get;list;watch
// +kubebuilder:rbac:groups=certificates.k8s.io,resources=certificatesigningrequests/approval;certificatesigningrequests/status,verbs=update
// +kubebuilder:rbac:groups=certificates.k8s.io,resources=signers,resourceNames=imp.dev/agent-access,verbs=approve;sign

// NodeNameClaim is the user extra of a token bound to a pod that names the pod's node.
const NodeNameClaim = "authentication.kubernetes.io/node-name"

// Reconciler approves and signs the agents' certificate signing requests.
type Reconciler struct {
	Client client.Client
	// CA signs.
	CA func() (pki.Pair, error)
	// AgentUser is the agents' user name, system:serviceaccount:NAMESPACE:imp-agent.
	AgentUser string
	Clock     clock.PassiveClock
}

// Reconcile decides one request: denied with the reason, or approved and signed.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	csr := &certv1.CertificateSigningRequest{}
	if err := r.Client.Get(ctx, req.NamespacedName, csr); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if csr.Spec.SignerName != pki.SignerName || len(csr.Status.Certificate) > 0 ||
		condition(csr, certv1.CertificateDenied) || condition(csr, certv1.CertificateFailed) {
		return ctrl.Result{}, nil
	}
	log := ctrl.LoggerFrom(ctx)
	pub, node, err := r.verify(csr)
	if err != nil {
		log.Info("denying an agent certificate request", "user", csr.Spec.Username, "reason", err.Error())
		return ctrl.Result{}, r.decide(ctx, csr, certv1.CertificateDenied, "NotAnAgentOfItsNode", err.Error())
	}
	if !condition(csr, certv1.CertificateApproved) {
		if err := r.decide(ctx, csr, certv1.CertificateApproved, "AgentOfItsNode", "the requester is the agent of node "+node); err != nil {
			return ctrl.Result{}, err
		}
	}
	ca, err := r.CA()
	if err != nil {
		return ctrl.Result{}, fmt.Errorf("signing for node %s: %w", node, err)
	}
	life := pki.LeafLifetime
	if s := csr.Spec.ExpirationSeconds; s != nil && time.Duration(*s)*time.Second < life {
		life = max(time.Duration(*s)*time.Second, time.Hour)
	}
	leaf, err := pki.Issue(ca, pki.Request{CommonName: pki.AgentName, DNSNames: []string{pki.AgentDNSName(node)}, Server: true,
		Client: slices.Contains(csr.Spec.Usages, certv1.UsageClientAuth), Lifetime: life, PublicKey: pub}, r.Clock.Now())
	if err != nil {
		return ctrl.Result{}, err
	}
	// The leaf, then the CA: the agent's endpoint accepts clients of that CA only.
	csr.Status.Certificate = append(leaf.Cert, ca.Cert...)
	if err := r.Client.Status().Update(ctx, csr); err != nil {
		return ctrl.Result{}, fmt.Errorf("signing for node %s: %w", node, err)
	}
	log.Info("signed an agent's certificate", "node", node, "csr", csr.Name)
	return ctrl.Result{}, nil
}

// verify checks that csr comes from an agent, bound to a node, and asks for that node's
// certificate and nothing else; it returns the key to certify and the node.
func (r *Reconciler) verify(csr *certv1.CertificateSigningRequest) (any, string, error) {
	if csr.Spec.Username != r.AgentUser {
		return nil, "", fmt.Errorf("requested by %q, not the agents' identity %q", csr.Spec.Username, r.AgentUser)
	}
	nodes := csr.Spec.Extra[NodeNameClaim]
	if len(nodes) != 1 || nodes[0] == "" {
		return nil, "", errors.New("the requester's token names no node (a token bound to its imp-runtime pod does)")
	}
	node := nodes[0]
	block, _ := pem.Decode(csr.Spec.Request)
	if block == nil || block.Type != "CERTIFICATE REQUEST" {
		return nil, "", errors.New("the request is not a PEM certificate request")
	}
	req, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return nil, "", fmt.Errorf("the request: %w", err)
	}
	if err := req.CheckSignature(); err != nil {
		return nil, "", fmt.Errorf("the request's signature: %w", err)
	}
	want := pki.AgentDNSName(node)
	if !slices.Equal(req.DNSNames, []string{want}) || len(req.IPAddresses) > 0 || len(req.URIs) > 0 || len(req.EmailAddresses) > 0 {
		return nil, "", fmt.Errorf("the request names %v %v %v %v; an agent of node %s may ask for %q only", req.DNSNames, req.IPAddresses, req.URIs, req.EmailAddresses, node, want)
	}
	for _, u := range csr.Spec.Usages {
		// Client use: an agent connects to another node's agent for a migration, which takes
		// it by its name (transfer.PeerNode); the access endpoints take the operator's name
		// alone, so an agent's certificate is no key to them.
		if u != certv1.UsageDigitalSignature && u != certv1.UsageServerAuth && u != certv1.UsageKeyEncipherment && u != certv1.UsageClientAuth {
			return nil, "", fmt.Errorf("usage %q: an agent's certificate serves and connects to agents, nothing else", u)
		}
	}
	return req.PublicKey, node, nil
}

// decide sets a condition of type t on csr through its approval subresource.
func (r *Reconciler) decide(ctx context.Context, csr *certv1.CertificateSigningRequest, t certv1.RequestConditionType, reason, message string) error {
	csr.Status.Conditions = append(csr.Status.Conditions, certv1.CertificateSigningRequestCondition{Type: t, Status: corev1.ConditionTrue,
		Reason: reason, Message: message, LastUpdateTime: metav1.NewTime(r.Clock.Now())})
	if err := r.Client.SubResource("approval").Update(ctx, csr); err != nil {
		return fmt.Errorf("marking request %s %s: %w", csr.Name, t, err)
	}
	return nil
}

func condition(csr *certv1.CertificateSigningRequest, t certv1.RequestConditionType) bool {
	for _, c := range csr.Status.Conditions {
		if c.Type == t && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

// SetupWithManager watches the requests for SignerName.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&certv1.CertificateSigningRequest{}, builder.WithPredicates(predicate.NewPredicateFuncs(func(o client.Object) bool {
			csr, ok := o.(*certv1.CertificateSigningRequest)
			return ok && csr.Spec.SignerName == pki.SignerName
		}))).
		Named("agentcsr").
		Complete(r)
}
