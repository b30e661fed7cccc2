package guestinit

import (
	"reflect"
	"testing"
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
