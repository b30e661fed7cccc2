package migration

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/agent/transfer"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Endpoint serves the node's side of migrations on Addr, over mutually authenticated TLS with
// the agents' certificates (Identity): the run's record to a migration's target (Files), the
// streams a migration's source opens (Streams). A manager's Runnable.
type Endpoint struct {
	Addr     string
	Identity transfer.Identity
	Files    func(ctx context.Context, node string, migration types.UID) (map[string]transfer.File, error)
	Streams  func(ctx context.Context, node string, migration types.UID, name string) (func(net.Conn), error)
	Log      logr.Logger
}

// Start serves until ctx ends.
func (e *Endpoint) Start(ctx context.Context) error {
	files := &transfer.Server{Authorize: e.Files, Log: e.Log}
	// Two streams a migration (its disk's, its memory's): sixteen take eight migrations to or
	// from the node at once.
	streams := &transfer.Streams{Authorize: e.Streams, Concurrent: 16}
	mux := http.NewServeMux()
	mux.Handle("GET /migrations/{uid}/files/{name}", files.Handler())
	mux.Handle("POST /migrations/{uid}/streams/{name}", streams.Handler())
	ln, err := net.Listen("tcp", e.Addr)
	if err != nil {
		return fmt.Errorf("listening on %s for migrations: %w", e.Addr, err)
	}
	// HTTP/1.1 only: a stream takes its connection over (an Upgrade), which HTTP/2 has not.
	srv := &http.Server{Handler: mux, TLSConfig: transfer.ServerTLS(e.Identity), ReadHeaderTimeout: 10 * time.Second, MaxHeaderBytes: 16 << 10,
		TLSNextProto: map[string]func(*http.Server, *tls.Conn, http.Handler){}}
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	e.Log.Info("taking migrations", "address", ln.Addr().String())
	if err := srv.ServeTLS(ln, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// NeedLeaderElection: every agent serves its own node.
func (e *Endpoint) NeedLeaderElection() bool { return false }

// EmptyDisk is the target's writable disk before the source's mirror fills it: a sparse file
// of the VM's disk size (the mirror writes every block the source holds).
type EmptyDisk struct{}

func (EmptyDisk) Name() string { return "empty_disk" }

func (EmptyDisk) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	if r.VM.Status.Resources == nil {
		return false, errors.New("the VM has no resources recorded by its placement")
	}
	_, err := os.Stat(r.Path(vmrun.WritableDisk))
	if errors.Is(err, fs.ErrNotExist) {
		return true, nil
	}
	return false, err
}

func (EmptyDisk) Do(_ context.Context, r *vmrun.Run) error {
	f, err := os.OpenFile(r.Path(vmrun.WritableDisk)+".tmp", os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(r.VM.Status.Resources.DiskSize.Value())
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("making the empty writable disk: %w", err)
	}
	return os.Rename(r.Path(vmrun.WritableDisk)+".tmp", r.Path(vmrun.WritableDisk))
}
