package metricsauth_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/go-logr/logr"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"

	"github.com/syscode-labs/imp/internal/metricsauth"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// countingTokens counts the TokenReviews that reach the API server.
type countingTokens struct {
	metricsauth.TokenReviewer
	n int
}

func (c *countingTokens) Create(ctx context.Context, r *authenticationv1.TokenReview, o metav1.CreateOptions) (*authenticationv1.TokenReview, error) {
	c.n++
	return c.TokenReviewer.Create(ctx, r, o)
}

// TestOnlyAuthorizedReaders scrapes through the filter, reviewing as the chart's agent: the
// API server decides, with the chart's imp-metrics-reader role, who reads the metrics.
func TestOnlyAuthorizedReaders(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	admin := kubernetes.NewForConfigOrDie(c.Config)
	agent := kubernetes.NewForConfigOrDie(c.As(t, testcluster.Agent)) // installs the chart's roles too

	token := func(sa string) string {
		t.Helper()
		if _, err := admin.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		tr, err := admin.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authenticationv1.TokenRequest{
			Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](600)}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("a token for %s: %v", sa, err)
		}
		return tr.Status.Token
	}
	reader, other := token("prometheus"), token("someone")
	binding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: ns + "-reader"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "imp-metrics-reader"},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: ns, Name: "prometheus"}}}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = admin.RbacV1().ClusterRoleBindings().Delete(context.WithoutCancel(ctx), binding.Name, metav1.DeleteOptions{})
	})
	// The API server's authorizer sees a binding (or its removal) a moment after it is written
	// (its RBAC cache): the scrapes below wait for that, as a reader granted a role would.
	authorized := func(want bool) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			sar, err := admin.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
				User: "system:serviceaccount:" + ns + ":prometheus", NonResourceAttributes: &authorizationv1.NonResourceAttributes{Path: "/metrics", Verb: "get"}}}, metav1.CreateOptions{})
			if err == nil && sar.Status.Allowed == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the binding of imp-metrics-reader never took effect (allowed %v): %+v %v", want, sar, err)
			}
		}
	}
	authorized(true)

	clock := clocktesting.NewFakePassiveClock(time.Now())
	tokens := &countingTokens{TokenReviewer: agent.AuthenticationV1().TokenReviews()}
	r := &metricsauth.Reviewer{Tokens: tokens, Access: agent.AuthorizationV1().SubjectAccessReviews(), Clock: clock}
	h, err := r.Filter(logr.Discard(), http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("metrics")) }))
	if err != nil {
		t.Fatal(err)
	}
	scrape := func(method, path, auth string) int {
		req := httptest.NewRequest(method, path, nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		return w.Code
	}

	for _, tc := range []struct {
		name, method, path, auth string
		want                     int
	}{
		{"the reader", "GET", "/metrics", "Bearer " + reader, http.StatusOK},
		{"the reader, the scheme in lower case (as the API server reads it)", "GET", "/metrics", "bearer " + reader, http.StatusOK},
		{"no token", "GET", "/metrics", "", http.StatusUnauthorized},
		{"the scheme alone", "GET", "/metrics", "Bearer", http.StatusUnauthorized},
		{"another scheme", "GET", "/metrics", "Basic " + reader, http.StatusUnauthorized},
		{"the reader's token and more", "GET", "/metrics", "Bearer " + reader + " " + other, http.StatusUnauthorized},
		{"a token the API server did not issue", "GET", "/metrics", "Bearer not-a-token", http.StatusUnauthorized},
		{"a signed token, altered", "GET", "/metrics", "Bearer " + reader[:len(reader)-4] + "AAAA", http.StatusUnauthorized},
		{"another account", "GET", "/metrics", "Bearer " + other, http.StatusForbidden},
		{"the reader, another path", "GET", "/debug/pprof/", "Bearer " + reader, http.StatusForbidden},
		{"the reader, another verb", "POST", "/metrics", "Bearer " + reader, http.StatusForbidden},
	} {
		if got := scrape(tc.method, tc.path, tc.auth); got != tc.want {
			t.Errorf("%s: %s %s got %d, want %d", tc.name, tc.method, tc.path, got, tc.want)
		}
	}

	// Answers are kept: scraping again reviews nothing, and a revoked reader keeps reading
	// until its allowance expires, as with the API server's own delegated authorization.
	before := tokens.n
	if err := admin.RbacV1().ClusterRoleBindings().Delete(ctx, binding.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := scrape("GET", "/metrics", "Bearer "+reader); got != http.StatusOK {
		t.Errorf("the reader, again within the cache: got %d, want 200", got)
	}
	if tokens.n != before {
		t.Errorf("a scrape within the token's TTL made %d TokenReviews", tokens.n-before)
	}
	authorized(false)
	clock.SetTime(clock.Now().Add(metricsauth.AllowTTL + time.Second))
	if got := scrape("GET", "/metrics", "Bearer "+reader); got != http.StatusForbidden {
		t.Errorf("the revoked reader, after the allowance expired: got %d, want 403", got)
	}
	if tokens.n != before+1 {
		t.Errorf("past the token's TTL: %d TokenReviews, want 1", tokens.n-before)
	}
}

// TestFilterWithTheComponentsConfig builds the filter as the metrics server does.
func TestFilterWithTheComponentsConfig(t *testing.T) {
	c := testcluster.Require(t, shared)
	cfg := c.As(t, testcluster.Agent)
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		t.Fatal(err)
	}
	f, err := metricsauth.Filter(cfg, hc)
	if err != nil {
		t.Fatal(err)
	}
	h, err := f(logr.Discard(), http.NotFoundHandler())
	if err != nil {
		t.Fatal(err)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", "/metrics", nil))
	if w.Code != http.StatusUnauthorized {
		t.Errorf("no token: got %d, want 401", w.Code)
	}
}
