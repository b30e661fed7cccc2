package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"

	"github.com/syscode-labs/imp/internal/testcluster"
)

type auditEvent struct {
	Verb string `json:"verb"`
	User struct {
		Username string `json:"username"`
	} `json:"user"`
	ImpersonatedUser *struct {
		Username string `json:"username"`
	} `json:"impersonatedUser"`
	ObjectRef *struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
		Name        string `json:"name"`
	} `json:"objectRef"`
}

// requests counts requests by who ("operator", "agents", "bench") and "verb resource[/sub]".
type requests map[string]map[string]int

// countRequests reads the audit log from offset from to offset to.
func countRequests(path string, from, to int64) (requests, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := requests{}
	sc := bufio.NewScanner(io.NewSectionReader(f, from, to-from))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var ev auditEvent
		if json.Unmarshal(sc.Bytes(), &ev) != nil || ev.ObjectRef == nil {
			continue
		}
		who := whoOf(ev)
		what := ev.ObjectRef.Resource
		if ev.ObjectRef.Subresource != "" {
			what += "/" + ev.ObjectRef.Subresource
		}
		if out[who] == nil {
			out[who] = map[string]int{}
		}
		out[who][ev.Verb+" "+what]++
	}
	return out, sc.Err()
}

// whoOf is who made ev: "operator", "agents" or "bench".
func whoOf(ev auditEvent) string {
	user := ev.User.Username
	if ev.ImpersonatedUser != nil {
		user = ev.ImpersonatedUser.Username
	}
	switch {
	case strings.HasSuffix(user, ":"+testcluster.Operator):
		return "operator"
	case strings.HasSuffix(user, ":"+testcluster.Agent):
		return "agents"
	}
	return "bench"
}

func size(path string) int64 {
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return st.Size()
}

// isWrite: a request that changes something.
func isWrite(verbAndResource string) bool {
	verb, _, _ := strings.Cut(verbAndResource, " ")
	return verb != "get" && verb != "list" && verb != "watch"
}

// writes is who's writes, and of them those to Events.
func (r requests) writes(who string) (all, events int) {
	for k, n := range r[who] {
		if isWrite(k) {
			all += n
			if strings.HasSuffix(k, " events") {
				events += n
			}
		}
	}
	return all, events
}

// describe lists who's requests per VM, most first.
func (r requests) describe(who string, vms int) string {
	keys := make([]string, 0, len(r[who]))
	for k := range r[who] {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		return r[who][keys[i]] > r[who][keys[j]] || r[who][keys[i]] == r[who][keys[j]] && keys[i] < keys[j]
	})
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %.2f", k, float64(r[who][k])/float64(vms)))
	}
	return strings.Join(parts, ", ")
}

// countNamedWrites counts, by who, the writes from offset from to offset to on objects of
// resource (its subresources included) named one of names.
func countNamedWrites(path string, from, to int64, resource string, names []string) (map[string]int, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	want := map[string]bool{}
	for _, n := range names {
		want[n] = true
	}
	out := map[string]int{}
	sc := bufio.NewScanner(io.NewSectionReader(f, from, to-from))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var ev auditEvent
		if json.Unmarshal(sc.Bytes(), &ev) != nil || ev.ObjectRef == nil || ev.ObjectRef.Resource != resource || !isWrite(ev.Verb+" ") {
			continue
		}
		name := ev.ObjectRef.Name
		if name == "" || !want[name] {
			continue
		}
		out[whoOf(ev)]++
	}
	return out, sc.Err()
}
