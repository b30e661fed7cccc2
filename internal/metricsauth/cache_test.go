package metricsauth

import (
	"strconv"
	"testing"
	"time"
)

func TestCacheIsBounded(t *testing.T) {
	now := time.Now()
	var c ttlCache[bool]
	c.put("old", true, now.Add(-time.Hour), time.Minute) // expired by now
	for i := range 2 * maxCacheLength {
		c.put(strconv.Itoa(i), true, now, time.Minute)
		if len(c.entries) > maxCacheLength {
			t.Fatalf("after %d puts the cache holds %d entries, more than %d", i+2, len(c.entries), maxCacheLength)
		}
	}
	if _, ok := c.entries["old"]; ok {
		t.Error("a full cache kept an expired entry")
	}
	if v, ok := c.get(strconv.Itoa(2*maxCacheLength-1), now); !v || !ok {
		t.Error("the last entry put is not kept")
	}
}

func TestCacheExpires(t *testing.T) {
	now := time.Now()
	var c ttlCache[string]
	c.put("k", "v", now, time.Minute)
	for _, tc := range []struct {
		at   time.Duration
		want bool
	}{{0, true}, {time.Minute - time.Nanosecond, true}, {time.Minute, false}, {time.Hour, false}} {
		if _, ok := c.get("k", now.Add(tc.at)); ok != tc.want {
			t.Errorf("at +%v: found %v, want %v", tc.at, ok, tc.want)
		}
	}
	if _, ok := c.get("other", now); ok {
		t.Error("an absent key is found")
	}
}
