package hostnet

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// TapTraffic is what a VM's tap carried, as the node's kernel counts it, from the guest's
// side: received is what the node delivered to the guest, transmitted what the guest sent
// (including what its anti-spoofing rules and policies then dropped). The guest cannot
// count for another VM: each VM has a tap of its own.
type TapTraffic struct {
	ReceiveBytes, ReceivePackets   uint64
	TransmitBytes, TransmitPackets uint64
	// At is when the node read them.
	At time.Time
}

// Taps is what every VM's tap on the node carried, by tap name (TapName): one netlink dump
// per network namespace. It changes nothing on the node (what is left of a namespace is for
// Sync to remove). A namespace that cannot be read is left out, its error returned with the
// others' taps.
func (h *Host) Taps() (map[string]TapTraffic, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	ids, err := h.spaceIDs()
	if err != nil {
		return nil, err
	}
	out := map[string]TapTraffic{}
	var errs []error
	for _, id := range ids {
		s, err := h.openSpace(id)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if s == nil {
			continue
		}
		links, err := s.nl.LinkList()
		at := time.Now()
		if err != nil {
			errs = append(errs, fmt.Errorf("listing the links of %s: %w", s.path, err))
			continue
		}
		for _, l := range links {
			a := l.Attrs()
			if !strings.HasPrefix(a.Name, tapPrefix) || a.Statistics == nil {
				continue
			}
			// A tap's receive is what its VMM wrote (the guest sent); its transmit what the
			// node gave the VMM to read (the guest received).
			st := a.Statistics
			out[a.Name] = TapTraffic{ReceiveBytes: st.TxBytes, ReceivePackets: st.TxPackets,
				TransmitBytes: st.RxBytes, TransmitPackets: st.RxPackets, At: at}
		}
	}
	return out, errors.Join(errs...)
}
