package migration

import (
	"context"
	"errors"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/syscode-labs/imp/internal/agent/transfer"
)

// TestOnlyTheSourceOpensStreams: the target takes a migration's streams from the migration's
// source node alone, only while it waits for that migration, one stream for each disk it
// serves and one memory stream only (a second would have the VMM take a second state), and no
// stream of another name (a disk it does not serve among them).
func TestOnlyTheSourceOpensStreams(t *testing.T) {
	tg := &Target{in: map[types.UID]*incoming{"mig-1": {source: "node-a", dir: t.TempDir(),
		disks: map[string]bool{diskStream("rw"): false, diskStream("vol-data"): false}}}}
	ctx := context.Background()
	for _, tc := range []struct {
		node, name string
		uid        types.UID
	}{
		{"node-c", "memory", "mig-1"}, // another node's agent
		{"node-c", "disk-rw", "mig-1"},
		{"node-a", "memory", "mig-2"}, // a migration this node does not wait for
		{"node-a", "config", "mig-1"}, // no such stream
		{"node-a", "disk-config", "mig-1"},
		{"node-a", "disk-base", "mig-1"},
		{"node-a", "disk-vol-other", "mig-1"},
		{"node-a", "disk", "mig-1"},
		{"node-a", "../../etc", "mig-1"},
	} {
		if _, err := tg.Authorize(ctx, tc.node, tc.uid, tc.name); !errors.Is(err, transfer.ErrNotAllowed) {
			t.Errorf("%s opening %s of %s: %v; want refused", tc.node, tc.name, tc.uid, err)
		}
	}
	for _, name := range []string{"disk-rw", "disk-vol-data", "memory"} {
		if _, err := tg.Authorize(ctx, "node-a", "mig-1", name); err != nil {
			t.Errorf("the source's stream %s: %v", name, err)
		}
		if _, err := tg.Authorize(ctx, "node-a", "mig-1", name); !errors.Is(err, transfer.ErrNotAllowed) {
			t.Errorf("a second stream %s: %v; want refused", name, err)
		}
	}
}

// TestTheSourceForgetsWhatItSentOnlyOnceItCannotComeAgain: a migration sent (or failed) is
// never sent again while any migration may still name it (24 h at most), and is forgotten
// after: the source's memory of them is bounded by that window, not the agent's lifetime.
func TestTheSourceForgetsWhatItSentOnlyOnceItCannotComeAgain(t *testing.T) {
	now := clocktesting.NewFakePassiveClock(time.Unix(1_800_000_000, 0))
	s := &Source{Clock: now}
	s.markDone("first")
	now.SetTime(now.Now().Add(24 * time.Hour))
	s.markDone("second")
	if !s.isDone("first") || !s.isDone("second") {
		t.Fatal("a migration sent a day ago is forgotten while one may still last that long")
	}
	now.SetTime(now.Now().Add(2 * time.Hour))
	s.markDone("third")
	if s.isDone("first") || !s.isDone("second") || !s.isDone("third") || len(s.done) != 2 {
		t.Errorf("after 26 hours the source remembers %v; want the second and third alone", s.done)
	}
}
