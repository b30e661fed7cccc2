package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// externalMetrics is a fake external metrics adapter (what KEDA serves to the HPA controller):
// external.metrics.k8s.io/v1beta1 with one metric, whose value the test sets. It listens on
// the node's address, where the API server's aggregator reaches it through a Service without a
// selector (the control plane routes to endpoints: --enable-aggregator-routing).
type externalMetrics struct {
	srv   *httptest.Server
	name  string
	value atomic.Int64
}

func serveExternalMetrics(t *testing.T, addr, metric string) *externalMetrics {
	t.Helper()
	m := &externalMetrics{name: metric}
	const gv = "external.metrics.k8s.io/v1beta1"
	mux := http.NewServeMux()
	write := func(w http.ResponseWriter, v any) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(v)
	}
	mux.HandleFunc("/apis/"+gv, func(w http.ResponseWriter, _ *http.Request) {
		write(w, map[string]any{"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
			"resources": []any{map[string]any{"name": "*", "singularName": "", "namespaced": true, "kind": "ExternalMetricValueList", "verbs": []string{"get"}}}})
	})
	mux.HandleFunc("/apis/"+gv+"/namespaces/", func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasSuffix(r.URL.Path, "/"+m.name) {
			http.NotFound(w, r)
			return
		}
		write(w, map[string]any{"kind": "ExternalMetricValueList", "apiVersion": gv, "metadata": map[string]any{},
			"items": []any{map[string]any{"metricName": m.name, "metricLabels": map[string]string{},
				"timestamp": time.Now().UTC().Format(time.RFC3339), "value": fmt.Sprint(m.value.Load())}}})
	})
	mux.HandleFunc("/", http.NotFound)
	m.srv = httptest.NewUnstartedServer(mux)
	l, err := net.Listen("tcp", net.JoinHostPort(addr, "0"))
	if err != nil {
		t.Fatal(err)
	}
	m.srv.Listener = l
	m.srv.StartTLS()
	t.Cleanup(m.srv.Close)
	return m
}

func (m *externalMetrics) port() int { return m.srv.Listener.Addr().(*net.TCPAddr).Port }

// objects are the Service, EndpointSlice and APIService that make the API server serve it.
func (m *externalMetrics) objects(ns, addr string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: fake-metrics, namespace: %[1]s}
spec:
  ports: [{name: https, port: 443, targetPort: %[3]d}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: fake-metrics
  namespace: %[1]s
  labels: {kubernetes.io/service-name: fake-metrics}
addressType: IPv4
endpoints: [{addresses: ["%[2]s"], conditions: {ready: true}}]
ports: [{name: https, port: %[3]d, protocol: TCP}]
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {name: v1beta1.external.metrics.k8s.io}
spec:
  group: external.metrics.k8s.io
  version: v1beta1
  service: {name: fake-metrics, namespace: %[1]s, port: 443}
  insecureSkipTLSVerify: true
  groupPriorityMinimum: 100
  versionPriority: 100
`, ns, addr, m.port())
}
