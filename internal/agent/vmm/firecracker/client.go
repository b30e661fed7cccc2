package firecracker

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/syscode-labs/imp/internal/agent/vmm"
)

// MaxResponseBytes bounds an answer of the API (the largest, GET /vm/config, is a few KiB).
const MaxResponseBytes = 1 << 20

// maxFault bounds the fault message an error carries (it reaches a VM's status).
const maxFault = 512

// Client speaks Firecracker's API over its unix socket.
type Client struct {
	http *http.Client
}

// NewClient returns a client of the API socket at path.
func NewClient(path string) *Client {
	return newClient(func(context.Context) (net.Conn, error) { return vmm.DialUnix(path) })
}

func newClient(dial func(context.Context) (net.Conn, error)) *Client {
	return &Client{http: &http.Client{
		Timeout: 30 * time.Second,
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dial(ctx)
		}},
	}}
}

// APIError is a request Firecracker refused, with its fault message.
type APIError struct {
	Method, Path string
	Status       int
	Fault        string
}

func (e *APIError) Error() string {
	return fmt.Sprintf("firecracker %s %s: %d: %s", e.Method, e.Path, e.Status, e.Fault)
}

// Do sends a request with a JSON body (nil for none) and decodes a JSON answer into out (nil
// to ignore it).
func (c *Client) Do(ctx context.Context, method, path string, body, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://firecracker"+path, rd)
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("firecracker %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	// A compromised VMM may answer with gigabytes: the agent reads no more than any answer
	// of the API needs.
	data, err := io.ReadAll(io.LimitReader(resp.Body, MaxResponseBytes+1))
	if err != nil {
		return fmt.Errorf("firecracker %s %s: reading the answer: %w", method, path, err)
	}
	if len(data) > MaxResponseBytes {
		return fmt.Errorf("firecracker %s %s: the answer is longer than %d bytes", method, path, MaxResponseBytes)
	}
	if resp.StatusCode >= 300 {
		var f struct {
			FaultMessage string `json:"fault_message"`
		}
		_ = json.Unmarshal(data, &f)
		if f.FaultMessage == "" {
			f.FaultMessage = string(data)
		}
		if len(f.FaultMessage) > maxFault {
			f.FaultMessage = f.FaultMessage[:maxFault] + "..."
		}
		return &APIError{Method: method, Path: path, Status: resp.StatusCode, Fault: f.FaultMessage}
	}
	if out != nil && len(data) > 0 {
		return json.Unmarshal(data, out)
	}
	return nil
}

// Bodies of the requests the driver sends (Firecracker API v1.16).
type (
	MachineConfig struct {
		VCPUCount  int   `json:"vcpu_count"`
		MemSizeMiB int64 `json:"mem_size_mib"`
		SMT        bool  `json:"smt"`
	}
	BootSource struct {
		KernelImagePath string `json:"kernel_image_path"`
		InitrdPath      string `json:"initrd_path,omitempty"`
		BootArgs        string `json:"boot_args,omitempty"`
	}
	TokenBucket struct {
		Size       int64 `json:"size"`
		RefillTime int64 `json:"refill_time"` // milliseconds
	}
	RateLimiter struct {
		Bandwidth *TokenBucket `json:"bandwidth,omitempty"`
		Ops       *TokenBucket `json:"ops,omitempty"`
	}
	Drive struct {
		DriveID      string       `json:"drive_id"`
		PathOnHost   string       `json:"path_on_host"`
		IsRootDevice bool         `json:"is_root_device"`
		IsReadOnly   bool         `json:"is_read_only"`
		RateLimiter  *RateLimiter `json:"rate_limiter,omitempty"`
	}
	NetworkInterface struct {
		IfaceID     string `json:"iface_id"`
		HostDevName string `json:"host_dev_name"`
		GuestMAC    string `json:"guest_mac,omitempty"`
		MTU         int    `json:"mtu,omitempty"`
	}
	Vsock struct {
		GuestCID uint32 `json:"guest_cid"`
		UDSPath  string `json:"uds_path"`
	}
	Logger struct {
		LogPath string `json:"log_path"`
		Level   string `json:"level,omitempty"`
	}
	Metrics struct {
		MetricsPath string `json:"metrics_path"`
	}
	Serial struct {
		SerialOutPath string `json:"serial_out_path"`
	}
	Action struct {
		ActionType string `json:"action_type"`
	}
	VMState struct {
		State string `json:"state"`
	}
	SnapshotCreate struct {
		SnapshotType string `json:"snapshot_type,omitempty"`
		SnapshotPath string `json:"snapshot_path"`
		MemFilePath  string `json:"mem_file_path"`
	}
	MemoryBackend struct {
		BackendType string `json:"backend_type"`
		BackendPath string `json:"backend_path"`
	}
	SnapshotLoad struct {
		SnapshotPath string         `json:"snapshot_path"`
		MemBackend   *MemoryBackend `json:"mem_backend,omitempty"`
		ResumeVM     bool           `json:"resume_vm"`
		// NetworkOverrides move a restored VM's interfaces to its own taps.
		NetworkOverrides []NetworkOverride `json:"network_overrides,omitempty"`
	}
	// NetworkOverride is a snapshot load's new tap for an interface.
	NetworkOverride struct {
		IfaceID     string `json:"iface_id"`
		HostDevName string `json:"host_dev_name"`
	}
	// InstanceInfo is GET /.
	InstanceInfo struct {
		ID         string `json:"id"`
		State      string `json:"state"`
		VMMVersion string `json:"vmm_version"`
	}
)
