package guestinit

import (
	"context"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// clockTicks is USER_HZ, what /proc/stat counts in on Linux.
const clockTicks = 100

// reportStats tells the host the guest's Stats every StatsInterval until ctx ends.
func reportStats(ctx context.Context, ch *channel) {
	t := time.NewTicker(StatsInterval)
	defer t.Stop()
	for {
		if s, err := readStats(); err == nil {
			ch.tell(Message{Event: StatsEvent, Stats: s})
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func readStats() (*Stats, error) {
	mem, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return nil, err
	}
	s := &Stats{}
	if s.MemoryTotal, s.MemoryAvailable, err = ParseMeminfo(string(mem)); err != nil {
		return nil, err
	}
	stat, err := os.ReadFile("/proc/stat")
	if err != nil {
		return nil, err
	}
	if s.CPUMillis, err = ParseCPU(string(stat), clockTicks); err != nil {
		return nil, err
	}
	var fs unix.Statfs_t
	if unix.Statfs("/", &fs) == nil {
		s.FilesystemSize, s.FilesystemFree = fs.Blocks*uint64(fs.Bsize), fs.Bavail*uint64(fs.Bsize)
	}
	return s, nil
}
