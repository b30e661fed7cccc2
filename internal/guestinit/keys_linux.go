package guestinit

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/guestsession"
)

// The OS's users' SSH keys (ImpVM spec.accessCredentials, docs/os.md "SSH keys"): the guest
// side writes a block of each user's ~/.ssh/authorized_keys between these markers, replaced
// whole at each request (an old key is gone at once), and leaves the user's own lines.
const (
	keysBegin = "# BEGIN IMP accessCredentials: written by IMP, replaced whole"
	keysEnd   = "# END IMP accessCredentials"
	// keysTmp is the file written in ~/.ssh and renamed over authorized_keys.
	keysTmp = ".authorized_keys.imp"
	// maxAuthorizedKeys bounds an authorized_keys file the guest side reads.
	maxAuthorizedKeys = 1 << 20
)

var userName = regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,31}$`)

// keyWriter writes users' keys under root ("/" in the guest). Every path below a user's home
// is opened relative to the directory above it and never through a symlink: the user owns
// ~/.ssh and could point root's write anywhere else.
type keyWriter struct {
	root string
	// given records the users written before (a root-only file on the OS's disk, which outlives
	// a restart of the VM), so that a user taken out of the VM's accessCredentials, even while
	// it was stopped, has its block emptied.
	given string
	mu    sync.Mutex
}

// keysWithin bounds a request's writing: a user's file system that blocks (a FUSE mount of
// theirs) holds the writer, not the agent; later requests are refused while it is held.
const keysWithin = 10 * time.Second

// give is write within keysWithin, one request at a time.
func (k *keyWriter) give(keys guestsession.AuthorizedKeys) ([]string, error) {
	if !k.mu.TryLock() {
		return nil, errors.New("an earlier request for the users' keys is still being written")
	}
	type result struct {
		pending []string
		err     error
	}
	done := make(chan result, 1)
	go func() {
		defer k.mu.Unlock()
		p, err := k.write(keys)
		done <- result{p, err}
	}()
	select {
	case r := <-done:
		return r.pending, r.err
	case <-time.After(keysWithin):
		return nil, fmt.Errorf("writing the users' keys took more than %v", keysWithin)
	}
}

// write gives each user of keys its lines, empties the block of users given keys before and
// not named now, and returns the users the OS does not have yet. Its caller holds k.mu.
func (k *keyWriter) write(keys guestsession.AuthorizedKeys) ([]string, error) {
	for u, lines := range keys {
		if !userName.MatchString(u) {
			return nil, fmt.Errorf("user %q: not a user name", u)
		}
		for _, l := range lines {
			if strings.ContainsAny(l, "\n\r\x00") || strings.HasPrefix(strings.TrimSpace(l), "#") {
				return nil, fmt.Errorf("user %s: a key line that is not one key", u)
			}
		}
	}
	before := k.readGiven()
	for _, u := range before {
		if _, ok := keys[u]; !ok {
			keys[u] = nil
		}
	}
	users, err := k.passwd()
	if err != nil {
		return nil, err
	}
	var pending, errs, written []string
	names := make([]string, 0, len(keys))
	for u := range keys {
		names = append(names, u)
	}
	slices.Sort(names)
	for _, u := range names {
		pw, ok := users[u]
		if !ok {
			if len(keys[u]) > 0 {
				pending = append(pending, u)
			}
			continue
		}
		if err := k.writeUser(pw, keys[u]); err != nil {
			errs = append(errs, err.Error())
			written = append(written, u) // tried: kept, to be emptied later if taken out
			continue
		}
		if len(keys[u]) > 0 {
			written = append(written, u)
		}
	}
	k.writeGiven(written)
	if len(errs) > 0 {
		return pending, errors.New(strings.Join(errs, "; "))
	}
	return pending, nil
}

func (k *keyWriter) readGiven() []string {
	var users []string
	if b, err := os.ReadFile(k.given); err == nil {
		_ = json.Unmarshal(b, &users)
	}
	return users
}

func (k *keyWriter) writeGiven(users []string) {
	slices.Sort(users)
	b, _ := json.Marshal(slices.Compact(users))
	if err := os.MkdirAll(filepath.Dir(k.given), 0o700); err != nil {
		fmt.Fprintln(os.Stderr, "imp-init: recording the users given SSH keys:", err)
		return
	}
	if err := os.WriteFile(k.given, b, 0o600); err != nil {
		fmt.Fprintln(os.Stderr, "imp-init: recording the users given SSH keys:", err)
	}
}

// passwdEntry is what the writer needs of a user.
type passwdEntry struct {
	name     string
	uid, gid int
	home     string
}

// passwd reads the OS's /etc/passwd (the guest side is static: no NSS).
func (k *keyWriter) passwd() (map[string]passwdEntry, error) {
	f, err := os.Open(filepath.Join(k.root, "etc/passwd"))
	if err != nil {
		return nil, fmt.Errorf("reading the OS's users: %w", err)
	}
	defer f.Close()
	users := map[string]passwdEntry{}
	sc := bufio.NewScanner(io.LimitReader(f, 16<<20))
	for sc.Scan() {
		f := strings.Split(sc.Text(), ":")
		if len(f) < 7 {
			continue
		}
		uid, err1 := strconv.Atoi(f[2])
		gid, err2 := strconv.Atoi(f[3])
		if err1 != nil || err2 != nil || !filepath.IsAbs(f[5]) {
			continue
		}
		if _, dup := users[f[0]]; !dup {
			users[f[0]] = passwdEntry{name: f[0], uid: uid, gid: gid, home: filepath.Clean(f[5])}
		}
	}
	return users, sc.Err()
}

// writeUser replaces IMP's block of u's ~/.ssh/authorized_keys with lines.
func (k *keyWriter) writeUser(u passwdEntry, lines []string) error {
	home, err := unix.Open(filepath.Join(k.root, u.home), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("user %s: its home %s: %w", u.name, u.home, err)
	}
	defer unix.Close(home)
	var st unix.Stat_t
	if err := unix.Fstat(home, &st); err != nil {
		return fmt.Errorf("user %s: its home %s: %w", u.name, u.home, err)
	}
	if int(st.Uid) != u.uid && st.Uid != 0 {
		return fmt.Errorf("user %s: its home %s belongs to uid %d: refused", u.name, u.home, st.Uid)
	}
	made := false
	switch err := unix.Mkdirat(home, ".ssh", 0o700); {
	case err == nil:
		made = true
	case !errors.Is(err, unix.EEXIST):
		return fmt.Errorf("user %s: making ~/.ssh: %w", u.name, err)
	}
	// Opened, then checked and given to the user by its descriptor: never by its name, which
	// the user can point elsewhere in between.
	dir, err := unix.Openat(home, ".ssh", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
			return fmt.Errorf("user %s: ~/.ssh is not a directory (a symlink?): refused", u.name)
		}
		return fmt.Errorf("user %s: ~/.ssh: %w", u.name, err)
	}
	defer unix.Close(dir)
	if err := unix.Fstat(dir, &st); err != nil {
		return fmt.Errorf("user %s: ~/.ssh: %w", u.name, err)
	}
	switch {
	case made && st.Uid == 0:
		if err := unix.Fchown(dir, u.uid, u.gid); err != nil {
			return fmt.Errorf("user %s: ~/.ssh: %w", u.name, err)
		}
	case int(st.Uid) != u.uid:
		return fmt.Errorf("user %s: ~/.ssh belongs to uid %d: refused", u.name, st.Uid)
	}
	old, err := readAuthorizedKeys(dir, u.uid)
	if err != nil {
		return fmt.Errorf("user %s: %w", u.name, err)
	}
	next := withBlock(old, lines)
	if bytes.Equal(old, next) {
		return nil
	}
	if err := unix.Unlinkat(dir, keysTmp, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("user %s: ~/.ssh/%s: %w", u.name, keysTmp, err)
	}
	fd, err := unix.Openat(dir, keysTmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("user %s: ~/.ssh/%s: %w", u.name, keysTmp, err)
	}
	f := os.NewFile(uintptr(fd), keysTmp)
	_, err = f.Write(next)
	if err == nil {
		err = f.Chown(u.uid, u.gid)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = unix.Renameat(dir, keysTmp, dir, "authorized_keys")
	}
	if err != nil {
		_ = unix.Unlinkat(dir, keysTmp, 0)
		return fmt.Errorf("user %s: writing ~/.ssh/authorized_keys: %w", u.name, err)
	}
	return nil
}

// readAuthorizedKeys reads dir's authorized_keys: none is empty; one that is not a regular
// file of uid's with one link (a symlink, a FIFO, a hard link to a file of root's) is refused.
func readAuthorizedKeys(dir, uid int) ([]byte, error) {
	fd, err := unix.Openat(dir, "authorized_keys", unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	switch {
	case errors.Is(err, unix.ENOENT):
		return nil, nil
	case errors.Is(err, unix.ELOOP):
		return nil, errors.New("~/.ssh/authorized_keys is a symlink: refused")
	case err != nil:
		return nil, fmt.Errorf("~/.ssh/authorized_keys: %w", err)
	}
	f := os.NewFile(uintptr(fd), "authorized_keys")
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, errors.New("~/.ssh/authorized_keys is not a regular file: refused")
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); !ok || int(sys.Uid) != uid || sys.Nlink != 1 {
		return nil, errors.New("~/.ssh/authorized_keys is not the user's alone (another owner, or a hard link): refused")
	}
	b, err := io.ReadAll(io.LimitReader(f, maxAuthorizedKeys+1))
	if err != nil {
		return nil, fmt.Errorf("~/.ssh/authorized_keys: %w", err)
	}
	if len(b) > maxAuthorizedKeys {
		return nil, fmt.Errorf("~/.ssh/authorized_keys is larger than %d bytes: refused", maxAuthorizedKeys)
	}
	return b, nil
}

// withBlock is old without IMP's block (from its begin marker to its end marker, or to the
// file's end when the end is missing), and then the block of lines, if there are any.
func withBlock(old []byte, lines []string) []byte {
	var out bytes.Buffer
	in := false
	for _, l := range strings.SplitAfter(string(old), "\n") {
		switch t := strings.TrimRight(l, "\n"); {
		case l == "":
		case t == keysBegin:
			in = true
		case t == keysEnd && in:
			in = false
		case !in:
			out.WriteString(l)
			if !strings.HasSuffix(l, "\n") {
				out.WriteByte('\n')
			}
		}
	}
	if len(lines) > 0 {
		out.WriteString(keysBegin + "\n")
		for _, l := range lines {
			out.WriteString(l + "\n")
		}
		out.WriteString(keysEnd + "\n")
	}
	return out.Bytes()
}
