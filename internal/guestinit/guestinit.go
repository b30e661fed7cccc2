// Package guestinit is imp-init, PID 1 of every IMP guest, and the contract between it and the
// node agent: the workload configuration the agent hands each run on its configuration disk,
// the disk labels, and the messages of the guest channel.
//
// At boot imp-init mounts /proc, /sys and /dev, loads the initramfs's kernel modules, mounts the
// image's read-only base disk (label imp-base) under an overlay whose upper layer lives on the
// VM's writable disk (label imp-rw), switches into that root, runs the workload with its
// arguments, environment, user and working directory, reaps every orphan, forwards signals,
// and reports over the guest channel that it is ready and, at the end, the workload's exit
// code; then it syncs and powers the VM off.
package guestinit

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/syscode-labs/imp/internal/guestinit/probe"
)

// Labels of the two disks the agent attaches.
const (
	BaseLabel     = "imp-base"
	WritableLabel = "imp-rw"
)

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
	// Stdin: the workload reads the serial console (else /dev/null).
	Stdin bool `json:"stdin,omitempty"`
	// TTY: the serial console is the workload's controlling terminal, and its stdout and stderr.
	TTY bool `json:"tty,omitempty"`
	// Probes are the workload's startup, readiness and liveness probes, run in the guest.
	Probes probe.Set `json:"probes,omitempty"`
	// Volumes are the run's volumes; Mounts mount them, Devices put disks at device paths,
	// before the workload starts (volumes_linux.go).
	Volumes []Volume `json:"volumes,omitempty"`
	Mounts  []Mount  `json:"mounts,omitempty"`
	Devices []Device `json:"devices,omitempty"`
	// Hold: imp-init readies everything but the workload (network, volumes, sessions), says
	// ready with HeldMessage and waits: a restore whose configuration does not hold starts it
	// (a template snapshotted before its workload; a warm pool's member of one holds on).
	Hold bool `json:"hold,omitempty"`
	// OS: the image's own /sbin/init boots the guest (ImpVM spec.boot OS): imp-init hands PID 1
	// over to it and comes back as a service of it, the guest side (docs/os.md). Argv is
	// empty then.
	OS bool `json:"os,omitempty"`
	// CloudInit: an OS's VM with a cloud-init seed disk (spec.cloudInit): cloud-init runs;
	// without, imp-init turns it off. CloudInitNetwork: the seed configures the network too;
	// without, imp-init's network stays and cloud-init's network configuration is off.
	CloudInit        bool `json:"cloudInit,omitempty"`
	CloudInitNetwork bool `json:"cloudInitNetwork,omitempty"`
}

// HeldMessage is the message of the ready event of a guest whose workload is held (Config.Hold).
const HeldMessage = "held: the workload starts at a restore"

// VolumeSerialPrefix begins the serial of every disk volume's block device under QEMU, which
// imp-init never takes for one of the VM's own disks.
const VolumeSerialPrefix = "imp-vol"

// VolumeLabel is the ext4 label of a disk volume the agent formatted to be mounted.
const VolumeLabel = "imp-volume"

// Volume is one of a run's volumes: files (a Secret's, a ConfigMap's, the VM's own facts),
// which imp-init keeps on a read-only tmpfs, or a disk, a block device of the VM.
type Volume struct {
	Name string `json:"name"`
	// Files, of a volume of files.
	Files []File `json:"files,omitempty"`
	// Serial, of a disk: the serial of its block device (/sys/block/vdX/serial).
	Serial string `json:"serial,omitempty"`
}

// File is one file of a volume of files, at Path relative to the volume.
type File struct {
	Path string `json:"path"`
	Mode uint32 `json:"mode"`
	Data []byte `json:"data"`
}

// Mount mounts the volume named Volume at Path: a disk's ext4 file system (read-only with
// ReadOnly), or a volume of files (always read-only), whole or its SubPath alone.
type Mount struct {
	Volume   string `json:"volume"`
	Path     string `json:"path"`
	SubPath  string `json:"subPath,omitempty"`
	ReadOnly bool   `json:"readOnly,omitempty"`
}

// Device makes the disk volume named Volume a block device node at Path.
type Device struct {
	Volume string `json:"volume"`
	Path   string `json:"path"`
}

// Message is one line of JSON on the guest channel, from the guest to the agent.
type Message struct {
	// Event is "hello" (with the VM's token), "ready", "probe", "exit", "error",
	// "restored" (with the VM's new token) or "frozen".
	Event   string `json:"event"`
	Token   string `json:"token,omitempty"`
	Code    *int   `json:"code,omitempty"`
	Message string `json:"message,omitempty"`
	// Probe and OK: a "probe" event's probe (startup, readiness or liveness) and its verdict;
	// a startup or liveness probe reports only its failure, after which the workload is killed.
	Probe string `json:"probe,omitempty"`
	OK    *bool  `json:"ok,omitempty"`
	// Replay, on a "restored" event: the guest tells the connection its replay right after
	// it (what a new connection is told), so the agent need not ask for it.
	Replay bool `json:"replay,omitempty"`
	// Freezes, on a hello: the guest can freeze its workload for a snapshot ("freeze"), and
	// answers FrozenEvent once it is.
	Freezes bool `json:"freezes,omitempty"`
	// Stats, on a StatsEvent: what the guest's kernel says of its memory, CPU and root
	// filesystem.
	Stats *Stats `json:"stats,omitempty"`
	// Boot, on the first "ready" of a boot: how long imp-init's phases took.
	Boot *Boot `json:"boot,omitempty"`
}

// Boot is how a guest's boot went, in microseconds of its kernel's boot clock (CLOCK_BOOTTIME,
// 0 at the kernel's start): when imp-init began, each of its phases, and ready.
type Boot struct {
	Init   uint64  `json:"init"`
	Phases []Phase `json:"phases"`
	Ready  uint64  `json:"ready"`
}

// Phase is one phase of imp-init's boot: one of BootPhases, from Start to End.
type Phase struct {
	Name  string `json:"name"`
	Start uint64 `json:"start"`
	End   uint64 `json:"end"`
}

// BootPhases are imp-init's phases, in order: the kernel's file systems and devices mounted,
// its modules loaded, the guest channel opened, the VM's disks found and its root mounted, its
// network configured, its volumes mounted (after the switch into its root), its workload
// started.
var BootPhases = []string{"mounts", "modules", "channel", "disks", "network", "volumes", "workload"}

// MaxBootPhases bounds what a ready message may say of phases.
const MaxBootPhases = 8

// StatsEvent carries the guest's own figures, every StatsInterval once the workload runs; told
// the connection as it stands, never kept for the next.
const StatsEvent = "stats"

// StatsInterval is how often imp-init reports its Stats.
const StatsInterval = 5 * time.Second

// Stats are the guest's own figures, in bytes and milliseconds.
type Stats struct {
	// MemoryTotal and MemoryAvailable are /proc/meminfo's MemTotal and MemAvailable.
	MemoryTotal     uint64 `json:"memTotal"`
	MemoryAvailable uint64 `json:"memAvailable"`
	// CPUMillis is the CPU time the guest's vCPUs spent busy (/proc/stat: all but idle and
	// iowait), since boot.
	CPUMillis uint64 `json:"cpuMillis"`
	// FilesystemSize and FilesystemFree are the root filesystem's (the VM's writable disk,
	// under its overlay).
	FilesystemSize uint64 `json:"fsSize"`
	FilesystemFree uint64 `json:"fsFree"`
}

// ParseMeminfo reads MemTotal and MemAvailable (bytes) from /proc/meminfo's text.
func ParseMeminfo(text string) (total, available uint64, err error) {
	var seen int
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		v, perr := strconv.ParseUint(f[1], 10, 64)
		if perr != nil {
			continue
		}
		if len(f) > 2 && f[2] == "kB" {
			v <<= 10
		}
		switch f[0] {
		case "MemTotal:":
			total, seen = v, seen|1
		case "MemAvailable:":
			available, seen = v, seen|2
		}
	}
	if seen != 3 {
		return 0, 0, fmt.Errorf("meminfo without MemTotal and MemAvailable")
	}
	return total, available, nil
}

// ParseCPU reads the busy time (milliseconds) of /proc/stat's first "cpu" line, whose fields
// count ticks of hz a second: user nice system idle iowait irq softirq steal ...
func ParseCPU(text string, hz uint64) (uint64, error) {
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) < 5 || f[0] != "cpu" {
			continue
		}
		var busy uint64
		for i, v := range f[1:] {
			if i == 3 || i == 4 || i >= 8 { // idle, iowait; guest time is counted in user already
				continue
			}
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return 0, fmt.Errorf("/proc/stat's cpu line: %w", err)
			}
			busy += n
		}
		return busy * 1000 / hz, nil
	}
	return 0, fmt.Errorf("/proc/stat without a cpu line")
}

// FrozenEvent answers a "freeze" request: every process of the workload is stopped. It is
// told the connection that asked, never kept for the next.
const FrozenEvent = "frozen"

// Request is one line of JSON on the guest channel, from the agent to the guest. Requests
// carry the VM's token; imp-init ignores a request with another.
type Request struct {
	// Op is "stop": signal the workload to terminate (SIGTERM); "replay": tell this connection
	// what a new one is told (the history and the probes' latest verdicts); "freeze": stop
	// every process of the workload (its cgroup's freezer), answered FrozenEvent, before a
	// snapshot; "thaw": let them run again; or "restore": the guest was restored from a
	// snapshot as another VM, whose identity Restore gives (and then thaws the workload).
	Op    string `json:"op"`
	Token string `json:"token"`
	// Restore is a "restore" request's new identity.
	Restore *Restore `json:"restore,omitempty"`
}

// Restore is the identity of a VM restored from another's snapshot, which its guest takes on
// before the agent lets it do anything visible: imp-init steps the clock, reseeds the kernel's
// random state with Entropy, reads the VM's own configuration disk (its env, Secrets,
// hostname and probes, for every process it starts from then on), moves the network
// interface to the VM's MAC and address, takes Token as the channel's, and answers with a
// "restored" event carrying the new token.
type Restore struct {
	// Token is the VM's own guest channel token from now on.
	Token string `json:"token"`
	// Net is the VM's network as kernel command line parameters (Net.Params); empty: none.
	Net []string `json:"net,omitempty"`
	// UnixNano is the host's clock when the request was sent.
	UnixNano int64 `json:"unixNano"`
	// Entropy is fresh randomness from the host, mixed into the kernel's pool, which is then
	// reseeded: copies of one snapshot share its random state until then.
	Entropy []byte `json:"entropy"`
	// Config is the VM's own configuration, as its configuration disk holds it: the guest
	// takes it from here rather than reading the disk again (a guest of an older agent, without
	// it, reads the disk).
	Config *Config `json:"config,omitempty"`
}

// RestoredEvent is the guest's answer to a "restore" request, with the new token; an "error"
// event whose message begins with RestoreErrorPrefix says why it could not take it on.
const (
	RestoredEvent      = "restored"
	RestoreErrorPrefix = "restoring: "
)

// TokenParam is the kernel command line parameter carrying the VM's channel token.
const TokenParam = "imp.token"

// ChannelParam selects the guest channel's transport: absent, the virtio-serial port named
// ChannelName (QEMU); "vsock:<port>", a vsock connection to the host (CID 2) on that port
// (Firecracker, which forwards it to the host socket <uds_path>_<port>).
const ChannelParam = "imp.channel"

// Net is the guest's network as the agent passes it on the kernel command line:
//
//	imp.net=<address>/<bits>,<gateway>,<mtu>,<mac>  imp.dns=<server>,...[;<search>,...]
type Net struct {
	Address     netip.Prefix
	Gateway     netip.Addr
	MTU         int
	MAC         string
	Nameservers []string
	Searches    []string
}

// Kernel command line parameters of Net.
const (
	NetParam = "imp.net"
	DNSParam = "imp.dns"
)

// Params are n's kernel command line parameters.
func (n Net) Params() []string {
	p := []string{fmt.Sprintf("%s=%s,%s,%d,%s", NetParam, n.Address, n.Gateway, n.MTU, n.MAC)}
	if len(n.Nameservers) > 0 || len(n.Searches) > 0 {
		v := strings.Join(n.Nameservers, ",")
		if len(n.Searches) > 0 {
			v += ";" + strings.Join(n.Searches, ",")
		}
		p = append(p, DNSParam+"="+v)
	}
	return p
}

// ParseNet reads Net from kernel command line parameters; nil when there is none.
func ParseNet(params []string) (*Net, error) {
	var n *Net
	for _, p := range params {
		switch k, v, _ := strings.Cut(p, "="); k {
		case NetParam:
			f := strings.Split(v, ",")
			if len(f) != 4 {
				return nil, fmt.Errorf("%s=%q: want address/bits,gateway,mtu,mac", NetParam, v)
			}
			var err error
			n = &Net{MAC: f[3]}
			if n.Address, err = netip.ParsePrefix(f[0]); err != nil {
				return nil, fmt.Errorf("%s address: %w", NetParam, err)
			}
			if n.Gateway, err = netip.ParseAddr(f[1]); err != nil {
				return nil, fmt.Errorf("%s gateway: %w", NetParam, err)
			}
			if n.MTU, err = strconv.Atoi(f[2]); err != nil {
				return nil, fmt.Errorf("%s mtu: %w", NetParam, err)
			}
		}
	}
	if n == nil {
		return nil, nil
	}
	for _, p := range params {
		if v, ok := strings.CutPrefix(p, DNSParam+"="); ok {
			servers, searches, _ := strings.Cut(v, ";")
			n.Nameservers, n.Searches = list(servers), list(searches)
		}
	}
	return n, nil
}

// list splits a comma-separated list; nil when empty.
func list(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}
