package guestinit

import (
	"os"
	"reflect"
	"testing"

	"golang.org/x/sys/unix"
)

// TestRestoredConfig: a restored guest takes the configuration its request carries and refuses
// one with nothing to run. (Without one it reads its configuration disk: agent.TestSnapshotRestore
// with a guest of this imp-init covers the request; the disk's reading is the boot's.)
func TestRestoredConfig(t *testing.T) {
	want := Config{Argv: []string{"/serve"}, Env: []string{"A=1"}, Hostname: "copy-1"}
	got, err := restoredConfig(&Restore{Config: &want})
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Errorf("restoredConfig = %+v, %v; want the request's %+v", got, err, want)
	}
	if _, err := restoredConfig(&Restore{Config: &Config{}}); err == nil {
		t.Error("a configuration with no command was taken")
	}
}

// TestReseedThroughTheKeptURandom: a restore reseeds through the /dev/urandom opened at boot,
// and keeps it open for the next (a guest is restored again from its own snapshots); it
// refuses too little entropy. Needs CAP_SYS_ADMIN (RNDADDENTROPY), as imp-init has.
func TestReseedThroughTheKeptURandom(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("RNDADDENTROPY needs root")
	}
	prepareRestore()
	if urandom == nil {
		t.Fatal("/dev/urandom not kept open")
	}
	t.Cleanup(func() { urandom.Close(); urandom = nil })
	entropy := make([]byte, 64)
	for i := range 2 {
		if err := reseed(entropy); err != nil {
			t.Fatalf("reseed %d: %v", i+1, err)
		}
	}
	if _, err := unix.FcntlInt(urandom.Fd(), unix.F_GETFD, 0); err != nil {
		t.Errorf("the kept /dev/urandom was closed: %v", err)
	}
	if err := reseed(entropy[:16]); err == nil {
		t.Error("16 bytes of entropy were taken")
	}
}
