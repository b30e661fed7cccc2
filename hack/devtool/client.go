package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// get GETs url once, on a new connection, with a minute to answer, and prints the answer and
// how long it took: no retry, so a refused or reset connection is the command's failure.
func get(url string) error {
	client := &http.Client{Timeout: time.Minute, Transport: &http.Transport{DisableKeepAlives: true}}
	began := time.Now()
	resp, err := client.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	fmt.Printf("%s (%v)\n", strings.TrimSpace(string(b)), time.Since(began).Round(time.Millisecond))
	return nil
}

// fetch GETs url n times, each on a new connection, and prints how often each answer came:
// what a Service spreads over its endpoints. It fails when any request does, once one was
// answered: before, a refused connection is the node's proxy not having the Service's
// endpoints yet (it refuses what goes to a Service without them), waited for up to a minute;
// the API says an endpoint is ready before every node's proxy has programmed it.
func fetch(url, count string) error {
	n, err := strconv.Atoi(count)
	if err != nil {
		return fmt.Errorf("count %q: %w", count, err)
	}
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(200 * time.Millisecond) {
		resp, err := client.Get(url)
		if err == nil {
			resp.Body.Close()
			break
		}
		if !errors.Is(err, syscall.ECONNREFUSED) || time.Now().After(deadline) {
			return err
		}
	}
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
