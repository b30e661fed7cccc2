// Package endpoint gives the VMs of a node that declare ports their endpoint addresses: each an
// address of the node's block (ImpNode spec.endpointCIDR, which the operator assigns), kept by
// the VM for the life of its placement (in its run's record on the node), never two VMs' at
// once. The network's namespace forwards the address's declared ports to the VM (hostnet), and
// the operator's endpoint slices name it for the Services that select the VM.
package endpoint

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
)

// ErrNoBlock: the node has no endpoint block (the operator assigns none, or not yet).
var ErrNoBlock = errors.New("endpoint: the node has no endpoint block")

// Allocator hands out the addresses of the node's block.
type Allocator struct {
	// Block is the node's block; ErrNoBlock when it has none.
	Block func(ctx context.Context) (netip.Prefix, error)
	// Recorded are the addresses the node's VMs hold in their records (address → VM uid),
	// read once, when the allocator is first used (an agent that restarted).
	Recorded func() (map[netip.Addr]string, error)

	mu     sync.Mutex
	loaded bool
	byAddr map[netip.Addr]string
	byVM   map[string]netip.Addr
}

// Assign returns the address of the VM uid: the one it holds, else want when that is free and
// of the block (its record's, after an agent restart), else the lowest free one.
func (a *Allocator) Assign(ctx context.Context, uid string, want netip.Addr) (netip.Addr, error) {
	block, err := a.Block(ctx)
	if err != nil {
		return netip.Addr{}, err
	}
	block = block.Masked()
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.load(); err != nil {
		return netip.Addr{}, err
	}
	if cur, ok := a.byVM[uid]; ok && block.Contains(cur) {
		return cur, nil
	}
	if want.IsValid() && usable(block, want) && a.byAddr[want] == "" {
		a.hold(uid, want)
		return want, nil
	}
	for c := block.Addr().Next(); usable(block, c); c = c.Next() {
		if a.byAddr[c] == "" {
			a.hold(uid, c)
			return c, nil
		}
	}
	return netip.Addr{}, fmt.Errorf("every address of the node's endpoint block %s is held", block)
}

// usable: c is a host address of block (not its first or last).
func usable(block netip.Prefix, c netip.Addr) bool {
	return block.Contains(c) && c != block.Addr() && block.Contains(c.Next())
}

func (a *Allocator) hold(uid string, c netip.Addr) {
	if old, ok := a.byVM[uid]; ok {
		delete(a.byAddr, old)
	}
	a.byVM[uid], a.byAddr[c] = c, uid
}

// Release frees the address of the VM uid (it left the node).
func (a *Allocator) Release(uid string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if c, ok := a.byVM[uid]; ok {
		delete(a.byVM, uid)
		delete(a.byAddr, c)
	}
}

func (a *Allocator) load() error {
	if a.loaded {
		return nil
	}
	a.byAddr, a.byVM = map[netip.Addr]string{}, map[string]netip.Addr{}
	rec, err := a.Recorded()
	if err != nil {
		return fmt.Errorf("reading the endpoint addresses the node's VMs hold: %w", err)
	}
	for c, uid := range rec {
		if _, dup := a.byVM[uid]; !dup {
			a.hold(uid, c)
		}
	}
	a.loaded = true
	return nil
}
