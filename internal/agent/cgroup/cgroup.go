// Package cgroup places VMM processes in IMP's own cgroups, outside the agent's: the container
// runtime ends every process of the agent pod's cgroup when the pod goes, and an agent upgrade
// must never end a VM. It handles the unified hierarchy (cgroup v2) and the per-controller
// hierarchies of v1 and hybrid hosts.
package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Root is where the host's cgroup filesystems are mounted.
const Root = "/sys/fs/cgroup"

// Parent is IMP's cgroup below each hierarchy's root; every VM gets a child named for it.
const Parent = "imp"

// Place moves process pid (all its threads) into the cgroup Parent/name of every hierarchy
// under root, creating it; it returns the directories it used.
func Place(root, name string, pid int) ([]string, error) {
	var used []string
	var errs []error
	for _, h := range hierarchies(root) {
		dir := filepath.Join(h, Parent, name)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			errs = append(errs, err)
			continue
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("moving %d into %s: %w", pid, dir, err))
			continue
		}
		used = append(used, dir)
	}
	if len(used) == 0 {
		return nil, fmt.Errorf("placing process %d in a cgroup of its own: %w", pid, errors.Join(errs...))
	}
	return used, nil
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
