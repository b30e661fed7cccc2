package kubectlimp

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// topInterval is how far apart top's two readings are: a VM's CPU is the rate between them.
const topInterval = time.Second

func (o *options) topCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "top [NAME]",
		Short: "Show the CPU, memory and disk of a VM, or of every running VM of the namespace",
		Long: `Show what a VM uses, read twice a second apart from its node (the subresource
impvms/stats, which the view role may read): CPU, the rate of its VMM's CPU time (its vCPUs and
the VMM's own work); MEMORY, what its VMM holds on the node; GUEST-MEMORY (and its share) and
GUEST-DISK, used of total as the guest's own kernel says (reported by imp-init: the guest's
word, "-" when it said nothing lately); DISK, what its writable disk takes on the node;
NET-IN and NET-OUT, the rates its tap carried to and from it, as the node counts them ("-"
for a VM on no network).`,
		Args: cobra.MaximumNArgs(1),
		RunE: o.cmd(o.top),
	}
}

// topRow is one VM's two readings, or why it has none.
type topRow struct {
	Name          string           `json:"name"`
	First, Second *impv1.VMFigures `json:"-"`
	Figures       *impv1.VMFigures `json:"figures,omitempty"`
	CPUCores      *float64         `json:"cpuCores,omitempty"`
	// NetIn and NetOut are the rates (bytes a second) the VM's tap carried to and from it.
	NetIn  *float64 `json:"networkReceiveBytesPerSecond,omitempty"`
	NetOut *float64 `json:"networkTransmitBytesPerSecond,omitempty"`
	Error  string   `json:"error,omitempty"`
}

func (o *options) top(ctx context.Context, cfg *rest.Config, ns string, args []string) error {
	c, err := newClient(cfg)
	if err != nil {
		return err
	}
	var names []string
	if len(args) == 1 {
		names = args
	} else {
		var vms impv1.ImpVMList
		if err := c.List(ctx, &vms, client.InNamespace(ns)); err != nil {
			return err
		}
		for _, vm := range vms.Items {
			if vm.Status.Phase == impv1.VMRunning {
				names = append(names, vm.Name)
			}
		}
		if len(names) == 0 {
			fmt.Fprintf(o.errOut, "No running ImpVMs in namespace %s.\n", ns)
			return nil
		}
	}
	sort.Strings(names)
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	rows := make([]*topRow, len(names))
	for i, name := range names {
		rows[i] = &topRow{Name: name}
	}
	read := func(second bool) {
		for _, r := range rows {
			if r.Error != "" {
				continue
			}
			f, err := o.figures(ctx, hc, cfg, ns, r.Name)
			switch {
			case err != nil:
				r.Error = err.Error()
			case second:
				r.Second = f
			default:
				r.First = f
			}
		}
	}
	read(false)
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(topInterval):
	}
	read(true)
	for _, r := range rows {
		if r.First == nil || r.Second == nil {
			continue
		}
		r.Figures = r.Second
		if dt := r.Second.At.Sub(r.First.At.Time).Seconds(); dt > 0 {
			cores := max(r.Second.VMMCPUSeconds-r.First.VMMCPUSeconds, 0) / dt
			r.CPUCores = &cores
			// The taps' own reading times: the node reads them at most once a second.
			if a, b := r.First.Network, r.Second.Network; a != nil && b != nil {
				if dt := b.At.Sub(a.At.Time).Seconds(); dt > 0 {
					in, out := float64(b.ReceiveBytes-min(a.ReceiveBytes, b.ReceiveBytes))/dt, float64(b.TransmitBytes-min(a.TransmitBytes, b.TransmitBytes))/dt
					r.NetIn, r.NetOut = &in, &out
				}
			}
		}
	}
	switch o.output {
	case "json":
		b, _ := json.MarshalIndent(rows, "", "  ")
		_, err = fmt.Fprintln(o.out, string(b))
		return err
	case "yaml":
		b, err := yaml.Marshal(rows)
		if err != nil {
			return err
		}
		_, err = o.out.Write(b)
		return err
	}
	tw := tabwriter.NewWriter(o.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tCPU(cores)\tMEMORY\tGUEST-MEMORY\tGUEST-MEMORY%\tGUEST-DISK\tDISK\tNET-IN\tNET-OUT")
	failed := 0
	for _, r := range rows {
		if r.Figures == nil || r.CPUCores == nil {
			failed++
			fmt.Fprintf(o.errOut, "%s: %s\n", r.Name, r.Error)
			continue
		}
		f, guestMem, guestPct, guestDisk := r.Figures, "-", "-", "-"
		if g := f.Guest; g != nil {
			used := g.MemoryBytes - g.MemoryAvailableBytes
			guestMem = bytesOf(used) + "/" + bytesOf(g.MemoryBytes)
			guestPct = fmt.Sprintf("%d%%", used*100/max(g.MemoryBytes, 1))
			if g.FilesystemSizeBytes > 0 {
				guestDisk = bytesOf(g.FilesystemSizeBytes-g.FilesystemFreeBytes) + "/" + bytesOf(g.FilesystemSizeBytes)
			}
		}
		netIn, netOut := "-", "-"
		if r.NetIn != nil {
			netIn, netOut = rateOf(*r.NetIn), rateOf(*r.NetOut)
		}
		fmt.Fprintf(tw, "%s\t%.3f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Name, *r.CPUCores, bytesOf(f.VMMResidentBytes), guestMem, guestPct, guestDisk,
			bytesOf(f.DiskAllocatedBytes), netIn, netOut)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if failed == len(rows) {
		return fmt.Errorf("no figures for %d ImpVMs", failed)
	}
	return nil
}

// figures reads the VM's figures through the API server.
func (o *options) figures(ctx context.Context, hc *http.Client, cfg *rest.Config, ns, name string) (*impv1.VMFigures, error) {
	u, err := o.subresourceURL(cfg, ns, name, "stats", nil)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("reading the figures of ImpVM %s: %w", name, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("reading the figures of ImpVM %s: %s", name, refusal(resp.StatusCode, b))
	}
	f := &impv1.VMFigures{}
	if err := json.Unmarshal(b, f); err != nil {
		return nil, fmt.Errorf("reading the figures of ImpVM %s: %w", name, err)
	}
	return f, nil
}

// rateOf is bytes a second, in B, Ki or Mi a second.
func rateOf(n float64) string {
	switch {
	case n >= 10<<20:
		return fmt.Sprintf("%.0fMi/s", n/(1<<20))
	case n >= 10<<10:
		return fmt.Sprintf("%.0fKi/s", n/(1<<10))
	}
	return fmt.Sprintf("%.0fB/s", n)
}

// bytesOf is n in Mi or Gi, as kubectl top shows memory.
func bytesOf(n uint64) string {
	if n >= 10<<30 {
		return fmt.Sprintf("%dGi", n>>30)
	}
	return fmt.Sprintf("%dMi", n>>20)
}
