package firecracker_test

import (
	"context"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
)

// TestClientOfAVMMThatStreamsForever: a compromised Firecracker answers an API request with a
// body that never ends, as an answer and as a fault: the client refuses it once it passes
// MaxResponseBytes, having read about that much.
func TestClientOfAVMMThatStreamsForever(t *testing.T) {
	for _, status := range []int{http.StatusOK, http.StatusBadRequest} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "api.sock")
			l, err := net.Listen("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			var sent atomic.Int64
			srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(status)
				_, _ = w.Write([]byte(`{"fault_message": "`))
				chunk := []byte(strings.Repeat("a", 64<<10))
				for r.Context().Err() == nil {
					n, err := w.Write(chunk)
					sent.Add(int64(n))
					if err != nil {
						return
					}
				}
			})}
			go func() { _ = srv.Serve(l) }()
			defer srv.Close()
			var out map[string]any
			err = firecracker.NewClient(sock).Do(context.Background(), http.MethodGet, "/machine-config", nil, &out)
			if err == nil || !strings.Contains(err.Error(), "longer than") {
				t.Fatalf("Do: %v, want the answer refused as too long", err)
			}
			if got := sent.Load(); got > 8*firecracker.MaxResponseBytes {
				t.Errorf("the client read %d bytes of one answer, bound %d", got, firecracker.MaxResponseBytes)
			}
		})
	}
}
