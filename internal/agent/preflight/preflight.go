// Package preflight is imp-agent's --preflight mode, which the chart runs as a hook Job on
// every selected node before an install or upgrade: it checks that the node can run IMP's VMs
// and that the artifacts it would boot are the pinned ones.
package preflight

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/syscode-labs/imp/internal/agent/kvm"
)

// Firecracker versions IMP supports.
const (
	MinFirecracker = "1.15"
	MaxFirecracker = "1.16"
)

// Config says what to check.
type Config struct {
	// KVMDevice is checked with kvm.Check; RequireKVM makes a failure fatal.
	KVMDevice  string
	RequireKVM bool
	// Firecracker and Jailer are the VMM binaries; absent ones are reported, not fatal,
	// unless pinned.
	Firecracker, Jailer string
	// QEMU is the fallback VMM.
	QEMU string
	// Pins are files and the sha256 (hex) each must have.
	Pins []Pin
}

// Pin is a file and its expected sha256.
type Pin struct {
	Name, Path, SHA256 string
}

// Verify returns nil when the file has the pinned sha256, else why not.
func (p Pin) Verify() error {
	sum, err := fileSHA256(p.Path)
	if err != nil {
		return err
	}
	if !strings.EqualFold(sum, strings.TrimPrefix(p.SHA256, "sha256:")) {
		return fmt.Errorf("%s has sha256 %s, pinned %s", p.Path, sum, p.SHA256)
	}
	return nil
}

// Check is the outcome of one check.
type Check struct {
	Name   string
	OK     bool
	Fatal  bool // a failure that fails the preflight
	Detail string
}

// Run runs every check and returns them, and an error naming each fatal failure.
func Run(ctx context.Context, cfg Config) ([]Check, error) {
	var checks []Check
	add := func(c Check) { checks = append(checks, c) }

	if err := kvm.Check(cfg.KVMDevice); err != nil {
		add(Check{Name: "kvm", Fatal: cfg.RequireKVM, Detail: err.Error()})
	} else {
		add(Check{Name: "kvm", OK: true, Detail: cfg.KVMDevice + " answers KVM API version 12 and creates VMs"})
	}
	pinned := map[string]bool{}
	for _, p := range cfg.Pins {
		pinned[p.Path] = true
	}
	for _, b := range []struct{ name, path string }{{"firecracker", cfg.Firecracker}, {"jailer", cfg.Jailer}} {
		if b.path == "" {
			continue
		}
		v, err := FirecrackerVersion(ctx, b.path)
		switch {
		case errors.Is(err, os.ErrNotExist):
			add(Check{Name: b.name, Fatal: pinned[b.path], Detail: b.path + " is not installed (VMs use QEMU on this node)"})
		case err != nil:
			add(Check{Name: b.name, Fatal: true, Detail: err.Error()})
		case !Supported(v):
			add(Check{Name: b.name, Fatal: true, Detail: fmt.Sprintf("%s is version %s; IMP supports %s to %s", b.path, v, MinFirecracker, MaxFirecracker)})
		default:
			add(Check{Name: b.name, OK: true, Detail: fmt.Sprintf("%s version %s", b.path, v)})
		}
	}
	if cfg.QEMU != "" {
		if out, err := exec.CommandContext(ctx, cfg.QEMU, "--version").Output(); err != nil {
			add(Check{Name: "qemu", Detail: fmt.Sprintf("%s --version: %v", cfg.QEMU, err)})
		} else {
			add(Check{Name: "qemu", OK: true, Detail: strings.SplitN(string(out), "\n", 2)[0]})
		}
	}
	for _, p := range cfg.Pins {
		if err := p.Verify(); err != nil {
			add(Check{Name: "pin " + p.Name, Fatal: true, Detail: err.Error()})
		} else {
			add(Check{Name: "pin " + p.Name, OK: true, Detail: fmt.Sprintf("%s matches its pin", p.Path)})
		}
	}
	var failed []string
	for _, c := range checks {
		if !c.OK && c.Fatal {
			failed = append(failed, c.Name+": "+c.Detail)
		}
	}
	if len(failed) > 0 {
		return checks, fmt.Errorf("preflight failed: %s", strings.Join(failed, "; "))
	}
	return checks, nil
}

// Report writes checks one per line.
func Report(w io.Writer, checks []Check) {
	for _, c := range checks {
		state := "ok  "
		switch {
		case !c.OK && c.Fatal:
			state = "FAIL"
		case !c.OK:
			state = "warn"
		}
		fmt.Fprintf(w, "%s %-16s %s\n", state, c.Name, c.Detail)
	}
}

var versionRE = regexp.MustCompile(`v?(\d+)\.(\d+)\.(\d+)`)

// FirecrackerVersion runs a Firecracker or jailer binary with --version and parses what it
// prints ("Firecracker v1.16.1", "Jailer v1.16.1").
func FirecrackerVersion(ctx context.Context, path string) (string, error) {
	if _, err := os.Stat(path); err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, path, "--version").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s --version: %v: %s", path, err, strings.TrimSpace(string(out)))
	}
	m := versionRE.FindStringSubmatch(string(out))
	if m == nil {
		return "", fmt.Errorf("%s --version printed no version: %q", path, strings.TrimSpace(string(out)))
	}
	return m[1] + "." + m[2] + "." + m[3], nil
}

// Supported says whether a Firecracker version (major.minor.patch) is in IMP's range.
func Supported(version string) bool {
	v := minor(version)
	return v >= minor(MinFirecracker) && v <= minor(MaxFirecracker) && v > 0
}

func minor(v string) int {
	f := strings.Split(v, ".")
	if len(f) < 2 {
		return -1
	}
	a, err1 := strconv.Atoi(f[0])
	b, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil {
		return -1
	}
	return a*1000 + b
}

func fileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("reading %s: %w", path, err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
