package main

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"
)

// serveUDP answers each datagram on :7002 with "hello from <host>: <datagram>".
func serveUDP(host string) {
	c, err := net.ListenPacket("udp", ":7002")
	if err != nil {
		fmt.Println("hello: listen udp:", err)
		return
	}
	b := make([]byte, 1500)
	for {
		n, from, err := c.ReadFrom(b)
		if err != nil {
			continue
		}
		_, _ = c.WriteTo([]byte(fmt.Sprintf("hello from %s: %s", host, b[:n])), from)
	}
}

func serveTCP(host string) {
	l, err := net.Listen("tcp", ":7000")
	if err != nil {
		fmt.Println("hello: listen:", err)
		return
	}
	for {
		c, err := l.Accept()
		if err != nil {
			continue
		}
		fmt.Fprintf(c, "hello from %s\n", host)
		c.Close()
	}
}

// targets expands "icmp:10.0.0.2-4" into icmp:10.0.0.2, .3 and .4.
func targets(spec string) []string {
	var out []string
	for _, t := range strings.Split(spec, ",") {
		t = strings.TrimSpace(t)
		if addr, ok := strings.CutPrefix(t, "icmp:"); ok {
			first, last, isRange := strings.Cut(addr, "-")
			a, err := netip.ParseAddr(first)
			if err != nil {
				continue
			}
			n := 0
			if isRange {
				end, _ := strconv.Atoi(last)
				n = end - int(a.As4()[3])
			}
			for i := 0; i <= n; i++ {
				out = append(out, "icmp:"+a.String())
				a = a.Next()
			}
		} else if t != "" {
			out = append(out, t)
		}
	}
	return out
}

func probeLoop(spec string) {
	state := map[string]string{}
	ts := targets(spec)
	for seq := 1; ; seq++ {
		for _, t := range ts {
			var err error
			var who string
			if addr, ok := strings.CutPrefix(t, "icmp:"); ok {
				err = ping(addr, seq)
			} else if addr, ok := strings.CutPrefix(t, "tcp:"); ok {
				var c net.Conn
				if c, err = net.DialTimeout("tcp", addr, 400*time.Millisecond); err == nil {
					c.Close()
				}
			} else if addr, ok := strings.CutPrefix(t, "who:"); ok {
				who, err = greeting(addr)
			}
			s := "ok"
			if err != nil {
				s = "fail"
			} else if who != "" {
				s = "ok " + who
			}
			if state[t] != s {
				state[t] = s
				fmt.Printf("probe %s %s\n", t, s)
			}
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// greeting connects to another guest's server at addr and returns the host name it greets
// with ("hello from NAME").
func greeting(addr string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, 400*time.Millisecond)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(time.Second))
	buf := make([]byte, 64)
	n, _ := io.ReadAtLeast(c, buf, 1)
	name, ok := strings.CutPrefix(strings.TrimSpace(string(buf[:n])), "hello from ")
	if !ok || name == "" {
		return "", fmt.Errorf("no greeting from %s", addr)
	}
	return name, nil
}

// ping sends one ICMP echo request to addr and waits briefly for its reply.
func ping(addr string, seq int) error {
	c, err := net.Dial("ip4:icmp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	id := os.Getpid() & 0xffff
	msg := []byte{8, 0, 0, 0, byte(id >> 8), byte(id), byte(seq >> 8), byte(seq), 'i', 'm', 'p', '!'}
	binary.BigEndian.PutUint16(msg[2:], checksum(msg))
	if _, err := c.Write(msg); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(400 * time.Millisecond))
	buf := make([]byte, 1500)
	for {
		n, _, err := c.(*net.IPConn).ReadFrom(buf)
		if err != nil {
			return err
		}
		// ReadFrom (unlike Read) strips the IPv4 header.
		if n >= 8 && buf[0] == 0 && int(binary.BigEndian.Uint16(buf[4:])) == id && int(binary.BigEndian.Uint16(buf[6:])) == seq&0xffff {
			return nil
		}
	}
}

func checksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}
