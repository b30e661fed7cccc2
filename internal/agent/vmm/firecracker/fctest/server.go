package fctest

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// Config is the VM configuration the double has accepted: what a real Firecracker would run.
type Config struct {
	MachineConfig map[string]any            `json:"machine-config,omitempty"`
	BootSource    map[string]any            `json:"boot-source,omitempty"`
	Drives        map[string]map[string]any `json:"drives,omitempty"`
	NetIfaces     map[string]map[string]any `json:"network-interfaces,omitempty"`
	Vsock         map[string]any            `json:"vsock,omitempty"`
	Logger        map[string]any            `json:"logger,omitempty"`
	Metrics       map[string]any            `json:"metrics,omitempty"`
	Serial        map[string]any            `json:"serial,omitempty"`
	// GuestFrozen, of a snapshot's state: the guest's workload was frozen when it was taken
	// (what its memory would hold of imp-init's cgroup), as Server.GuestFrozen said.
	GuestFrozen bool `json:"guest-frozen,omitempty"`
}

// Server is the double. Its exported state is read under Lock.
type Server struct {
	api *API
	sync.Mutex
	Config  Config
	Started bool
	Paused  bool
	// CtrlAltDel counts SendCtrlAltDel actions; OnCtrlAltDel runs on each (a fake VMM exits).
	CtrlAltDel   int
	OnCtrlAltDel func()
	// ExitOnCtrlAltDel makes the process hang up on SendCtrlAltDel without answering, then
	// exit a moment later: a VMM whose guest stopped at once, caught between its hang-up and
	// its end.
	ExitOnCtrlAltDel bool
	// OnStart runs when the VM starts (InstanceStart or a resuming snapshot load), with its
	// configuration, before the request is answered: what it sets up (the guest's vsock
	// socket) is there once the start is, as Firecracker's is. It must not block.
	OnStart func(Config)
	// Root resolves the paths of snapshot files, as a jailed Firecracker's root does.
	Root string
	// GuestFrozen, when set, says whether the guest's workload is frozen, for the snapshot
	// state (Config.GuestFrozen).
	GuestFrozen func() bool
	// Refused records each refused request and why.
	Refused []string
	ln      net.Listener
	// ran: the guest has run (OnStart was called).
	ran bool
	// drives are the drives' backing files, open: Firecracker opens one as its drive is
	// configured (or its snapshot loaded) and holds it while it runs. Only with a Root.
	drives map[string]*os.File
	// taps are the network interfaces' taps, open (openTap).
	taps map[string]*os.File
}

// openDrive opens drive id's backing file at p (under Root) as Firecracker does, read-only
// or not, holding it in place of the drive's earlier one.
func (s *Server) openDrive(id, p string, readOnly bool) error {
	if s.Root == "" {
		return nil
	}
	flag := os.O_RDWR
	if readOnly {
		flag = os.O_RDONLY
	}
	f, err := os.OpenFile(filepath.Join(s.Root, p), flag, 0)
	if err != nil {
		return badRequest("Unable to create the virtio block device: cannot open the backing file %s: %v", p, err)
	}
	if s.drives == nil {
		s.drives = map[string]*os.File{}
	}
	if old := s.drives[id]; old != nil {
		old.Close()
	}
	s.drives[id] = f
	return nil
}

// Serve starts a double listening on the unix socket path (a long path is bound relative to
// its directory, as a jailed Firecracker binds its short one).
func Serve(path string) (*Server, error) {
	api, err := Extract()
	if err != nil {
		return nil, err
	}
	ln, err := listenLong(path)
	if err != nil {
		return nil, err
	}
	s := &Server{api: api, ln: ln}
	go func() { _ = http.Serve(ln, s) }()
	return s, nil
}

// Close stops the double.
func (s *Server) Close() error { return s.ln.Close() }

type fault struct {
	code int
	msg  string
}

func (f *fault) Error() string { return f.msg }

func badRequest(format string, args ...any) error {
	return &fault{http.StatusBadRequest, fmt.Sprintf(format, args...)}
}

// route finds the definition path of a request path ("/drives/rw" → "/drives/{drive_id}").
func (s *Server) route(p string) (pattern, id string) {
	for pat := range s.api.Paths {
		if i := strings.Index(pat, "{"); i > 0 {
			if rest, ok := strings.CutPrefix(p, pat[:i]); ok && rest != "" && !strings.Contains(rest, "/") {
				return pat, rest
			}
		} else if pat == p {
			return pat, ""
		}
	}
	return "", ""
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	s.Lock()
	defer s.Unlock()
	out, err := s.handle(r.Method, r.URL.Path, body)
	if err != nil {
		var f *fault
		code := http.StatusInternalServerError
		if errors.As(err, &f) {
			code = f.code
		}
		s.Refused = append(s.Refused, fmt.Sprintf("%s %s: %v", r.Method, r.URL.Path, err))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_ = json.NewEncoder(w).Encode(map[string]string{"fault_message": err.Error()})
		return
	}
	if out == nil {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

func (s *Server) handle(method, path string, body []byte) (any, error) {
	pattern, id := s.route(path)
	methods, ok := s.api.Paths[pattern]
	if !ok {
		return nil, &fault{http.StatusBadRequest, "Invalid request method and/or path: " + method + " " + path}
	}
	def, ok := methods[strings.ToLower(method)]
	if !ok {
		return nil, &fault{http.StatusBadRequest, "Invalid request method and/or path: " + method + " " + path}
	}
	var obj map[string]any
	if def != "" {
		if err := s.api.Validate(def, body); err != nil {
			return nil, badRequest("An error occurred when deserializing the json body of a request: %v", err)
		}
		_ = json.Unmarshal(body, &obj)
	}
	preBoot := func() error {
		if s.Started {
			return badRequest("The requested operation is not supported after starting the microVM.")
		}
		return nil
	}
	postBoot := func() error {
		if !s.Started {
			return badRequest("The requested operation is not supported before starting the microVM.")
		}
		return nil
	}
	c := &s.Config
	switch method + " " + pattern {
	case "GET /":
		state := "Not started"
		switch {
		case s.Started && s.Paused:
			state = "Paused"
		case s.Started:
			state = "Running"
		}
		return map[string]any{"id": "anonymous-instance", "state": state, "vmm_version": s.api.Version, "app_name": "Firecracker"}, nil
	case "GET /version":
		return map[string]any{"firecracker_version": s.api.Version}, nil
	case "GET /vm/config":
		return s.Config, nil
	case "GET /machine-config":
		return c.MachineConfig, nil
	case "PUT /machine-config":
		if err := preBoot(); err != nil {
			return nil, err
		}
		if n := obj["vcpu_count"].(float64); n != 1 && int(n)%2 != 0 {
			return nil, badRequest("Invalid machine configuration: the vCPU number is invalid! The vCPU number can only be 1 or an even number when SMT is enabled.")
		}
		c.MachineConfig = obj
	case "PUT /boot-source":
		if err := preBoot(); err != nil {
			return nil, err
		}
		c.BootSource = obj
	case "PUT /drives/{drive_id}":
		if err := preBoot(); err != nil {
			return nil, err
		}
		if obj["drive_id"] != id {
			return nil, badRequest("The id from the path [%s] does not match the id from the body [%v]!", id, obj["drive_id"])
		}
		p, _ := obj["path_on_host"].(string)
		ro, _ := obj["is_read_only"].(bool)
		if err := s.openDrive(id, p, ro); err != nil {
			return nil, err
		}
		if c.Drives == nil {
			c.Drives = map[string]map[string]any{}
		}
		c.Drives[id] = obj
	case "PATCH /drives/{drive_id}":
		if err := postBoot(); err != nil {
			return nil, err
		}
		d, ok := c.Drives[id]
		if !ok {
			return nil, badRequest("Drive %s not found", id)
		}
		if p, ok := obj["path_on_host"].(string); ok {
			ro, _ := d["is_read_only"].(bool)
			if err := s.openDrive(id, p, ro); err != nil {
				return nil, err
			}
		}
		for k, v := range obj {
			d[k] = v
		}
	case "PUT /network-interfaces/{iface_id}":
		if err := preBoot(); err != nil {
			return nil, err
		}
		if obj["iface_id"] != id {
			return nil, badRequest("The id from the path [%s] does not match the id from the body [%v]!", id, obj["iface_id"])
		}
		if name, _ := obj["host_dev_name"].(string); name != "" {
			if err := s.openTap(id, name); err != nil {
				return nil, badRequest("Could not create the network device: %v", err)
			}
		}
		if c.NetIfaces == nil {
			c.NetIfaces = map[string]map[string]any{}
		}
		c.NetIfaces[id] = obj
	case "PUT /vsock":
		if err := preBoot(); err != nil {
			return nil, err
		}
		if err := s.vsockFree(obj); err != nil {
			return nil, err
		}
		c.Vsock = obj
	case "PUT /serial":
		if err := preBoot(); err != nil {
			return nil, err
		}
		c.Serial = obj
	case "PUT /logger":
		c.Logger = obj
	case "PUT /metrics":
		if c.Metrics != nil {
			return nil, badRequest("Reinitialization of metrics not allowed.")
		}
		c.Metrics = obj
	case "PUT /actions":
		switch obj["action_type"] {
		case "InstanceStart":
			if err := preBoot(); err != nil {
				return nil, err
			}
			if c.BootSource == nil {
				return nil, badRequest("Cannot start microvm without kernel configuration.")
			}
			if c.MachineConfig == nil {
				c.MachineConfig = map[string]any{"vcpu_count": 1.0, "mem_size_mib": 128.0}
			}
			s.Started = true
			if s.OnStart != nil {
				s.ran = true
				s.OnStart(s.Config)
			}
		case "SendCtrlAltDel":
			if err := postBoot(); err != nil {
				return nil, err
			}
			s.CtrlAltDel++
			if s.ExitOnCtrlAltDel {
				go func() { time.Sleep(300 * time.Millisecond); os.Exit(0) }()
				panic(http.ErrAbortHandler) // the connection closed, unanswered
			}
			if s.OnCtrlAltDel != nil {
				go s.OnCtrlAltDel()
			}
		}
	case "PATCH /vm":
		if err := postBoot(); err != nil {
			return nil, err
		}
		s.Paused = obj["state"] == "Paused"
		if !s.Paused && !s.ran && s.OnStart != nil {
			// A snapshot loaded without resume_vm runs its guest from here.
			s.ran = true
			s.OnStart(s.Config)
		}
	case "PUT /snapshot/create":
		if err := postBoot(); err != nil {
			return nil, err
		}
		if !s.Paused {
			return nil, badRequest("Cannot create a snapshot of a running microVM: pause it first.")
		}
		taken := s.Config
		taken.GuestFrozen = s.GuestFrozen != nil && s.GuestFrozen()
		state, _ := json.Marshal(taken)
		if err := os.WriteFile(filepath.Join(s.Root, obj["snapshot_path"].(string)), state, 0o600); err != nil {
			return nil, badRequest("Cannot write the snapshot: %v", err)
		}
		if err := os.WriteFile(filepath.Join(s.Root, obj["mem_file_path"].(string)), []byte("guest memory"), 0o600); err != nil {
			return nil, badRequest("Cannot write the memory file: %v", err)
		}
	case "PUT /snapshot/load":
		if s.Started || c.MachineConfig != nil || c.BootSource != nil || len(c.Drives) > 0 || len(c.NetIfaces) > 0 || c.Vsock != nil {
			return nil, badRequest("Loading a microVM snapshot not allowed after configuring boot-specific resources.")
		}
		_, hasFile := obj["mem_file_path"]
		_, hasBackend := obj["mem_backend"]
		if hasFile == hasBackend {
			return nil, badRequest("Exactly one of mem_file_path and mem_backend must be given.")
		}
		state, err := os.ReadFile(filepath.Join(s.Root, obj["snapshot_path"].(string)))
		if err != nil {
			return nil, badRequest("Cannot open the snapshot file: %v", err)
		}
		logger, metrics := c.Logger, c.Metrics
		if err := json.Unmarshal(state, c); err != nil {
			return nil, badRequest("Cannot deserialize the microVM state: %v", err)
		}
		c.Logger, c.Metrics = logger, metrics
		// The drives' backing files must be where the snapshot's VM had them, as Firecracker
		// opens them at load ("accessible at the same relative paths", snapshot-support.md).
		for id, d := range c.Drives {
			p, _ := d["path_on_host"].(string)
			ro, _ := d["is_read_only"].(bool)
			if err := s.openDrive(id, p, ro); err != nil {
				return nil, badRequest("Cannot restore drive %s: %v", id, err)
			}
		}
		// network_overrides: an interface moved to another tap; one the snapshot lacks is an error.
		if ovs, ok := obj["network_overrides"].([]any); ok {
			for _, o := range ovs {
				ov, _ := o.(map[string]any)
				id, _ := ov["iface_id"].(string)
				iface, ok := c.NetIfaces[id]
				if !ok {
					return nil, badRequest("Invalid network override: the snapshot has no interface %q", id)
				}
				iface["host_dev_name"] = ov["host_dev_name"]
			}
		}
		for id, iface := range c.NetIfaces {
			name, _ := iface["host_dev_name"].(string)
			if err := s.openTap(id, name); err != nil {
				return nil, badRequest("Load snapshot error: Failed to restore from snapshot: Failed to build microVM from snapshot: Failed to restore the network device: %v", err)
			}
		}
		if err := s.vsockFree(c.Vsock); err != nil {
			return nil, err
		}
		s.Started = true
		s.Paused = obj["resume_vm"] != true
		if s.OnStart != nil && !s.Paused {
			s.ran = true
			s.OnStart(s.Config)
		}
	default:
		return nil, badRequest("the double does not serve %s %s", method, pattern)
	}
	return nil, nil
}

// vsockFree refuses a vsock device whose host socket exists: Firecracker binds uds_path when
// the device is made (configured, or loaded from a snapshot) and fails on an existing file.
func (s *Server) vsockFree(vsock map[string]any) error {
	p, _ := vsock["uds_path"].(string)
	if p == "" || s.Root == "" {
		return nil
	}
	if _, err := os.Lstat(filepath.Join(s.Root, p)); err == nil {
		return badRequest("Cannot create backend for vsock device: UnixBind(Os { code: 98, kind: AddrInUse, message: \"Address in use\" })")
	}
	return nil
}

// listenLong listens on a unix socket path, binding a long one (over 100 bytes) relative to
// its directory, as a jailed Firecracker binds its short one.
func listenLong(path string) (net.Listener, error) {
	_ = os.Remove(path)
	if len(path) < 100 {
		return net.Listen("unix", path)
	}
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return net.Listen("unix", fmt.Sprintf("/proc/self/fd/%d/%s", d.Fd(), filepath.Base(path)))
}
