package main

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
)

// fetch GETs url n times, each on a new connection, and prints how often each answer came:
// what a Service spreads over its endpoints. It fails when any request does.
func fetch(url, count string) error {
	n, err := strconv.Atoi(count)
	if err != nil {
		return fmt.Errorf("count %q: %w", count, err)
	}
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	seen := map[string]int{}
	for i := 0; i < n; i++ {
		resp, err := client.Get(url)
		if err != nil {
			return err
		}
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s: %s", url, resp.Status)
		}
		seen[strings.TrimSpace(string(b))]++
	}
	answers := make([]string, 0, len(seen))
	for a := range seen {
		answers = append(answers, a)
	}
	sort.Strings(answers)
	for _, a := range answers {
		fmt.Printf("%d× %s\n", seen[a], a)
	}
	return nil
}

// resolve prints the addresses name resolves to, sorted, one a line.
func resolve(name string) error {
	addrs, err := net.LookupHost(name)
	if err != nil {
		return err
	}
	sort.Strings(addrs)
	fmt.Println(strings.Join(addrs, "\n"))
	return nil
}
