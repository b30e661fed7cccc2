// Package cgroup places VMM processes in IMP's own cgroups, outside the agent's: the container
// runtime ends every process of the agent pod's cgroup when the pod goes, and an agent upgrade
// must never end a VM. It handles the unified hierarchy (cgroup v2) and the per-controller
// hierarchies of v1 and hybrid hosts.
package cgroup

import (
	"bufio"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Root is where the host's cgroup filesystems are mounted.
const Root = "/sys/fs/cgroup"

// Parent is IMP's cgroup below each hierarchy's root; every VM gets a child named for it.
const Parent = "imp"

// Limits bound what the processes of a VM's cgroup may use; zero leaves a resource unbounded.
type Limits struct {
	// MemoryBytes bounds memory, page cache included (the kernel reclaims cache first).
	MemoryBytes int64
	// Pids bounds processes and threads.
	Pids int64
	// CPUs bounds CPU time, in CPUs (1.5: one and a half CPUs' time per period).
	CPUs float64
	// Weight is the cgroup's share of contended CPU beside its siblings, on cgroup v2's scale
	// (1–10000, 100 the default; v1's cpu.shares is 1024 times it over 100); 0 leaves it.
	Weight int
}

// files are the limits as each cgroup version spells them; a hierarchy takes those whose file
// it has (v1: one controller per hierarchy).
func (l Limits) files() map[string]string {
	f := map[string]string{}
	if l.MemoryBytes > 0 {
		f["memory.max"] = strconv.FormatInt(l.MemoryBytes, 10)
		f["memory.limit_in_bytes"] = strconv.FormatInt(l.MemoryBytes, 10)
	}
	if l.Pids > 0 {
		f["pids.max"] = strconv.FormatInt(l.Pids, 10)
	}
	if l.Weight > 0 {
		maps.Copy(f, weightFiles(l.Weight))
	}
	if l.CPUs > 0 {
		const period = 100000
		quota := int64(l.CPUs * period)
		f["cpu.max"] = fmt.Sprintf("%d %d", quota, period)
		f["cpu.cfs_period_us"] = strconv.Itoa(period)
		f["cpu.cfs_quota_us"] = strconv.FormatInt(quota, 10)
	}
	return f
}

// Place moves process pid (all its threads) into the cgroup Parent/name of every hierarchy
// under root, creating it with lim in place first; it returns the directories it used. A
// hierarchy it cannot move the process into is an error: a VMM left in the agent container's
// cgroup there is ended with the agent's pod.
func Place(root, name string, pid int, lim Limits) ([]string, error) {
	s, err := Prepare(root, name, lim)
	if err != nil {
		return nil, err
	}
	return s.Join(pid, false)
}

// Set is a VM's cgroup in each hierarchy, made with its limits, for its VMM to be started in.
type Set struct {
	dirs    []string
	unified string // the one of the unified hierarchy (cgroup v2, or hybrid hosts'), if any
}

// Prepare creates the cgroup Parent/name of every hierarchy under root with lim in place, and
// returns them, for a process to start in (Unified) and join (Join).
func Prepare(root, name string, lim Limits) (*Set, error) {
	s := &Set{}
	var errs []error
	for _, h := range hierarchies(root) {
		dir := filepath.Join(h, Parent, name)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			errs = append(errs, err)
			continue
		}
		if err := inheritCpuset(filepath.Join(h, Parent), dir); err != nil {
			errs = append(errs, err)
			continue
		}
		// cgroup v2: the controllers must be enabled down to the VM's cgroup.
		for _, d := range []string{h, filepath.Join(h, Parent)} {
			_ = os.WriteFile(filepath.Join(d, "cgroup.subtree_control"), []byte("+memory +pids +cpu"), 0o644)
		}
		for file, v := range lim.files() {
			p := filepath.Join(dir, file)
			if _, err := os.Stat(p); err != nil {
				continue
			}
			if err := os.WriteFile(p, []byte(v), 0o644); err != nil {
				errs = append(errs, fmt.Errorf("setting %s to %s: %w", p, v, err))
			}
		}
		s.dirs = append(s.dirs, dir)
		if _, err := os.Stat(filepath.Join(h, "cgroup.controllers")); err == nil {
			s.unified = dir
		}
	}
	if len(errs) > 0 || len(s.dirs) == 0 {
		return nil, fmt.Errorf("preparing cgroups %s: %w", name, errors.Join(errs...))
	}
	return s, nil
}

// Unified opens the set's cgroup of the unified hierarchy, for a process to be started in it
// (syscall.SysProcAttr's UseCgroupFD: Linux's CLONE_INTO_CGROUP): it then never runs outside
// its limits there, and needs no move into it, which takes the kernel a grace period of RCU
// under its cgroup lock. Nil on a host without one.
func (s *Set) Unified() *os.File {
	if s.unified == "" {
		return nil
	}
	f, err := os.Open(s.unified)
	if err != nil {
		return nil
	}
	return f
}

// Join moves process pid (all its threads) into the set's cgroups, but the unified one when it
// was started in it (born), and returns the directories it is in. A hierarchy it cannot move
// the process into is an error: a VMM left in the agent container's cgroup there is ended with
// the agent's pod.
func (s *Set) Join(pid int, born bool) ([]string, error) {
	var used []string
	var errs []error
	for _, dir := range s.dirs {
		if !(born && dir == s.unified) {
			if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
				errs = append(errs, fmt.Errorf("moving %d into %s: %w", pid, dir, err))
				continue
			}
		}
		used = append(used, dir)
	}
	if len(errs) > 0 {
		return used, fmt.Errorf("placing process %d in cgroups of its own: %w", pid, errors.Join(errs...))
	}
	return used, nil
}

// MemoryStat is the value of key in the memory controller's memory.stat of the set's cgroup
// (in bytes for sizes: "shmem" is the shared memory, memfds included, charged there).
func (s *Set) MemoryStat(key string) (int64, error) {
	for _, dir := range s.dirs {
		f, err := os.Open(filepath.Join(dir, "memory.stat"))
		if err != nil {
			continue
		}
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), " "); ok && k == key {
				return strconv.ParseInt(v, 10, 64)
			}
		}
		return 0, fmt.Errorf("no %s in %s", key, filepath.Join(dir, "memory.stat"))
	}
	return 0, errors.New("no memory controller in the cgroups")
}

// inheritCpuset gives each of dirs, parents first, its parent's CPUs and memory nodes when it
// is a cgroup v1 cpuset without them: no process may join a cpuset until it has both.
func inheritCpuset(dirs ...string) error {
	for _, dir := range dirs {
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			cur, err := os.ReadFile(filepath.Join(dir, f))
			if err != nil || strings.TrimSpace(string(cur)) != "" {
				continue // not a cpuset, or one that has them
			}
			v, err := os.ReadFile(filepath.Join(filepath.Dir(dir), f))
			if err != nil {
				return fmt.Errorf("reading the parent's %s of %s: %w", f, dir, err)
			}
			if err := os.WriteFile(filepath.Join(dir, f), v, 0o644); err != nil {
				return fmt.Errorf("setting %s of %s: %w", f, dir, err)
			}
		}
	}
	return nil
}

// Remove deletes the cgroups of name; a cgroup still holding a process is left.
func Remove(root, name string) {
	for _, h := range hierarchies(root) {
		_ = os.Remove(filepath.Join(h, Parent, name))
	}
}

// hierarchies returns the cgroup hierarchies mounted under root: root itself when it is the
// unified hierarchy (v2), else each of its mounted subdirectories (v1 controllers, and the
// unified one of hybrid hosts).
func hierarchies(root string) []string {
	if _, err := os.Stat(filepath.Join(root, "cgroup.controllers")); err == nil {
		return []string{root}
	}
	entries, err := os.ReadDir(root)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range entries {
		p := filepath.Join(root, e.Name())
		if fi, err := os.Lstat(p); err != nil || !fi.IsDir() {
			continue // symlinks such as cpu -> cpu,cpuacct
		}
		if _, err := os.Stat(filepath.Join(p, "cgroup.procs")); err == nil {
			out = append(out, p)
		}
	}
	return out
}

// Of returns the cgroup paths of process pid, one line of /proc/<pid>/cgroup each.
func Of(pid int) ([]string, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return nil, err
	}
	return strings.Split(strings.TrimSpace(string(data)), "\n"), nil
}

// Version is the cgroup version of the hierarchy mounted at root: 2 for the unified
// hierarchy, else 1.
func Version(root string) int {
	if root == "" {
		root = Root
	}
	if _, err := os.Stat(filepath.Join(root, "cgroup.controllers")); err == nil {
		return 2
	}
	return 1
}

// DefaultWeight is a cgroup's CPU weight unless told otherwise.
const DefaultWeight = 100

// BackgroundWeight is the CPU weight of a warm pool member's VMM, restored to wait idle: a
// tenth of a VM's, so that a burst of claims is not slowed by the pool's refill.
const BackgroundWeight = DefaultWeight / 10

func weightFiles(w int) map[string]string {
	f1, v1 := WeightFile(1, w)
	f2, v2 := WeightFile(2, w)
	return map[string]string{f2: v2, f1: v1}
}

// WeightFile is the file and value that give a cgroup of version (1 or 2) the CPU weight w:
// cgroup v2's cpu.weight, or v1's cpu.shares (1024 for DefaultWeight).
func WeightFile(version, w int) (file, value string) {
	if version == 2 {
		return "cpu.weight", strconv.Itoa(w)
	}
	return "cpu.shares", strconv.Itoa(max(w*1024/DefaultWeight, 2))
}

// SetWeight sets the CPU weight (Limits.Weight) of the cgroup Parent/name in every hierarchy
// under root that has it.
func SetWeight(root, name string, weight int) error {
	var errs []error
	for _, h := range hierarchies(root) {
		for file, v := range weightFiles(weight) {
			p := filepath.Join(h, Parent, name, file)
			if _, err := os.Stat(p); err != nil {
				continue
			}
			if err := os.WriteFile(p, []byte(v), 0o644); err != nil {
				errs = append(errs, fmt.Errorf("setting %s to %s: %w", p, v, err))
			}
		}
	}
	return errors.Join(errs...)
}
