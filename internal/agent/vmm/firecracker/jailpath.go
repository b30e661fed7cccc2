package firecracker

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// The jail's run/ and snapshot/ directories belong to the VM's uid: a compromised VMM may put
// a symbolic link there, to another jail's API or vsock socket or files, and the agent (root)
// would follow it. Whatever the agent reaches in a jail it reaches through these, beneath the
// jail's root and without following any link.

// dialInJail connects to the unix socket at rel (a jail path, "/run/vsock.sock") of the jail
// whose root is root: opened beneath root with no symbolic link followed (openat2
// RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS), checked to be a socket, and connected to through its
// descriptor.
func dialInJail(root, rel string) (net.Conn, error) {
	fd, err := openInJail(root, rel, unix.O_PATH)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("%s in the jail: %w", rel, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return nil, fmt.Errorf("%s in the jail is not a socket", rel)
	}
	return net.Dial("unix", fmt.Sprintf("/proc/self/fd/%d", fd))
}

// openInJail opens rel beneath root with flags, following no symbolic link.
func openInJail(root, rel string, flags int) (int, error) {
	dir, err := os.OpenFile(root, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return -1, fmt.Errorf("opening the jail %s: %w", root, err)
	}
	defer dir.Close()
	fd, err := unix.Openat2(int(dir.Fd()), strings.TrimPrefix(rel, "/"), &unix.OpenHow{
		Flags:   uint64(flags | unix.O_CLOEXEC | unix.O_NOFOLLOW),
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return -1, &fs.PathError{Op: "open in jail", Path: rel, Err: err}
	}
	return fd, nil
}

// existsInJail says whether rel is there beneath root, no link followed.
func existsInJail(root, rel string) bool {
	fd, err := openInJail(root, rel, unix.O_PATH)
	if err != nil {
		return false
	}
	unix.Close(fd)
	return true
}

// removeInJail removes rel beneath root: never a file outside the jail, whatever links it
// holds (os.Root refuses to leave it). Absent is removed.
func removeInJail(root, rel string) error {
	r, err := os.OpenRoot(root)
	if err != nil {
		return fmt.Errorf("opening the jail %s: %w", root, err)
	}
	defer r.Close()
	if err := r.Remove(strings.TrimPrefix(rel, "/")); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// NewJailClient returns a client of the API socket of the jail whose root is root, dialled
// beneath it without following links (dialInJail).
func NewJailClient(root string) *Client {
	return newClient(func(context.Context) (net.Conn, error) { return dialInJail(root, jailAPISock) })
}
