// Package guestinit is imp-init, PID 1 of every IMP guest, and the contract between it and the
// node agent: the workload configuration the agent writes onto the VM's writable disk, the
// disk labels, and the messages of the guest channel.
//
// At boot imp-init mounts /proc, /sys and /dev, loads the initramfs's kernel modules, mounts the
// image's read-only base disk (label imp-base) under an overlay whose upper layer lives on the
// VM's writable disk (label imp-rw), switches into that root, runs the workload with its
// arguments, environment, user and working directory, reaps every orphan, forwards signals,
// and reports over the guest channel that it is ready and, at the end, the workload's exit
// code; then it syncs and powers the VM off.
package guestinit

// Labels of the two disks the agent attaches.
const (
	BaseLabel     = "imp-base"
	WritableLabel = "imp-rw"
)

// ConfigPath is where, on the writable disk (outside the overlay's upper directory), the agent
// writes the workload's Config as JSON.
const ConfigPath = "imp/config.json"

// ChannelName is the virtio-serial port name of the guest channel.
const ChannelName = "imp.channel"

// Config is the workload as the agent resolved it from the image and the ImpVM.
type Config struct {
	// Argv is the command line: the image's entrypoint and cmd, or the ImpVM's overrides.
	Argv []string `json:"argv"`
	// Env is the environment, "NAME=value".
	Env []string `json:"env,omitempty"`
	// WorkingDir is the directory the workload starts in (default /).
	WorkingDir string `json:"workingDir,omitempty"`
	// User is "uid", "uid:gid", "name" or "name:group", resolved in the image's /etc/passwd
	// and /etc/group (default root).
	User string `json:"user,omitempty"`
	// Hostname is the guest's host name.
	Hostname string `json:"hostname,omitempty"`
}

// Message is one line of JSON on the guest channel, from the guest to the agent.
type Message struct {
	// Event is "hello" (with the VM's token), "ready", "exit" or "error".
	Event   string `json:"event"`
	Token   string `json:"token,omitempty"`
	Code    *int   `json:"code,omitempty"`
	Message string `json:"message,omitempty"`
}

// Request is one line of JSON on the guest channel, from the agent to the guest. Requests
// carry the VM's token; imp-init ignores a request with another.
type Request struct {
	// Op is "stop": signal the workload to terminate (SIGTERM).
	Op    string `json:"op"`
	Token string `json:"token"`
}

// TokenParam is the kernel command line parameter carrying the VM's channel token.
const TokenParam = "imp.token"
