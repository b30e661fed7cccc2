package wake

import (
	"encoding/binary"
	"net"
	"net/netip"
)

const arpLen = 28

// arpReply is the guest's answer to the ARP request f when it asks for ip: ip is at mac. Nil
// for anything else (a reply, a gratuitous announcement, another address).
func arpReply(f []byte, ip netip.Addr, mac net.HardwareAddr) []byte {
	if len(f) < ethHdrLen+arpLen {
		return nil
	}
	a := f[ethHdrLen:]
	if binary.BigEndian.Uint16(a[0:2]) != 1 || binary.BigEndian.Uint16(a[2:4]) != etherTypeIPv4 || a[4] != 6 || a[5] != 4 ||
		binary.BigEndian.Uint16(a[6:8]) != 1 {
		return nil
	}
	spa, tpa := netip.AddrFrom4([4]byte(a[14:18])), netip.AddrFrom4([4]byte(a[24:28]))
	if tpa != ip || spa == tpa {
		return nil
	}
	r := make([]byte, ethHdrLen+arpLen)
	copy(r[0:6], a[8:14]) // to the asker's MAC
	copy(r[6:12], mac)
	binary.BigEndian.PutUint16(r[12:14], etherTypeARP)
	p := r[ethHdrLen:]
	binary.BigEndian.PutUint16(p[0:2], 1)
	binary.BigEndian.PutUint16(p[2:4], etherTypeIPv4)
	p[4], p[5] = 6, 4
	binary.BigEndian.PutUint16(p[6:8], 2)
	copy(p[8:14], mac)
	copy(p[14:18], a[24:28])
	copy(p[18:24], a[8:14])
	copy(p[24:28], a[14:18])
	return r
}

// ipv4 is the header of an IPv4 frame's packet, and where its payload is.
type ipv4 struct {
	hdr      []byte // the IP header
	payload  []byte
	proto    byte
	src, dst [4]byte
}

func parseIPv4(f []byte) (ipv4, bool) {
	if len(f) < ethHdrLen+20 {
		return ipv4{}, false
	}
	p := f[ethHdrLen:]
	ihl := int(p[0]&0x0f) * 4
	total := int(binary.BigEndian.Uint16(p[2:4]))
	if p[0]>>4 != 4 || ihl < 20 || total < ihl || total > len(p) || binary.BigEndian.Uint16(p[6:8])&0x1fff != 0 {
		return ipv4{}, false // not IPv4, malformed, or a later fragment
	}
	return ipv4{hdr: p[:ihl], payload: p[ihl:total], proto: p[9], src: [4]byte(p[12:16]), dst: [4]byte(p[16:20])}, true
}

// refusal is what a host with nothing listening answers to the IPv4 frame f: a reset to a TCP
// segment (never to a reset), ICMP port unreachable to a UDP datagram; nil to anything else.
func refusal(f []byte) []byte {
	ip, ok := parseIPv4(f)
	if !ok {
		return nil
	}
	var proto byte
	var l4 []byte
	switch ip.proto {
	case 6:
		t := ip.payload
		if len(t) < 20 || t[13]&0x04 != 0 {
			return nil
		}
		flags := t[13]
		seq, ack := binary.BigEndian.Uint32(t[4:8]), binary.BigEndian.Uint32(t[8:12])
		l4 = make([]byte, 20)
		copy(l4[0:2], t[2:4]) // from the port it was sent to
		copy(l4[2:4], t[0:2])
		l4[12] = 5 << 4
		if flags&0x10 != 0 { // ACK: the reset takes the sequence it acknowledged
			binary.BigEndian.PutUint32(l4[4:8], ack)
			l4[13] = 0x04
		} else {
			n := uint32(len(t) - int(t[12]>>4)*4)
			if flags&0x02 != 0 {
				n++
			}
			if flags&0x01 != 0 {
				n++
			}
			binary.BigEndian.PutUint32(l4[8:12], seq+n)
			l4[13] = 0x14 // RST, ACK
		}
		binary.BigEndian.PutUint16(l4[16:18], transportChecksum(ip.dst, ip.src, 6, l4))
		proto = 6
	case 17:
		quote := len(ip.hdr) + min(8, len(ip.payload))
		l4 = make([]byte, 8+quote)
		l4[0], l4[1] = 3, 3 // destination unreachable: port unreachable
		copy(l4[8:], f[ethHdrLen:ethHdrLen+quote])
		binary.BigEndian.PutUint16(l4[2:4], checksum(l4, 0))
		proto = 1
	default:
		return nil
	}
	r := make([]byte, ethHdrLen+20+len(l4))
	copy(r[0:6], f[6:12])
	copy(r[6:12], f[0:6])
	binary.BigEndian.PutUint16(r[12:14], etherTypeIPv4)
	h := r[ethHdrLen : ethHdrLen+20]
	h[0] = 0x45
	binary.BigEndian.PutUint16(h[2:4], uint16(20+len(l4)))
	binary.BigEndian.PutUint16(h[6:8], 0x4000) // don't fragment
	h[8], h[9] = 64, proto
	copy(h[12:16], ip.dst[:])
	copy(h[16:20], ip.src[:])
	binary.BigEndian.PutUint16(h[10:12], checksum(h, 0))
	copy(r[ethHdrLen+20:], l4)
	return r
}

// checksum is the Internet checksum of b, starting from sum.
func checksum(b []byte, sum uint32) uint16 {
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i : i+2]))
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

// transportChecksum is the checksum of a TCP or UDP segment with its IPv4 pseudo-header.
func transportChecksum(src, dst [4]byte, proto byte, seg []byte) uint16 {
	var sum uint32
	sum += uint32(binary.BigEndian.Uint16(src[0:2])) + uint32(binary.BigEndian.Uint16(src[2:4]))
	sum += uint32(binary.BigEndian.Uint16(dst[0:2])) + uint32(binary.BigEndian.Uint16(dst[2:4]))
	sum += uint32(proto) + uint32(len(seg))
	return checksum(seg, sum)
}
