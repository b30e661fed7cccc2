package guestmem_test

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/syscode-labs/imp/internal/agent/guestmem"
)

// stream builds a migration stream as QEMU 7.2 saves a paused microvm guest: the configuration,
// the RAM section (its blocks, pages in a start, a part and an end section), then the devices,
// which follow as opaque bytes.
type stream struct{ b []byte }

func (s *stream) u8(v byte)    { s.b = append(s.b, v) }
func (s *stream) u32(v uint32) { s.b = binary.BigEndian.AppendUint32(s.b, v) }
func (s *stream) u64(v uint64) { s.b = binary.BigEndian.AppendUint64(s.b, v) }
func (s *stream) str(v string) { s.u8(byte(len(v))); s.b = append(s.b, v...) }

func (s *stream) header() {
	s.u32(0x5145564d)
	s.u32(3)
	s.u8(0x07)
	s.u32(7)
	s.b = append(s.b, "microvm"...)
}

func (s *stream) start(blocks map[string]uint64, order []string) {
	s.u8(0x01)
	s.u32(2)
	s.str("ram")
	s.u32(0)
	s.u32(4)
	var total uint64
	for _, id := range order {
		total += blocks[id]
	}
	s.u64(total | 0x04)
	for _, id := range order {
		s.str(id)
		s.u64(blocks[id])
	}
}

// page adds a record: a whole page of data (len 4096) or a page of one byte.
func (s *stream) page(block string, off uint64, cont bool, data []byte) {
	flags := uint64(0x08)
	if len(data) == 1 {
		flags = 0x02
	}
	if cont {
		flags |= 0x20
	}
	s.u64(off | flags)
	if !cont {
		s.str(block)
	}
	s.b = append(s.b, data...)
}

func (s *stream) endOfSection(kind byte) {
	s.u64(0x10)
	s.u8(0x7e)
	s.u32(2)
	if kind != 0 {
		s.u8(kind)
		s.u32(2)
	}
}

const (
	ram  = "microvm.ram"
	bios = "pc.bios"
	mem  = 1 << 20
)

var devicesTail = []byte("\x04\x00\x00\x00\x03\x05timer\x00\x00\x00\x00\x00\x00\x00\x02opaque device state\x00")

func page(b byte) []byte { return bytes.Repeat([]byte{b}, 4096) }

// good is a stream with pages of both blocks, a page saved twice (data, then zero), a page
// of one nonzero byte, and records that continue their block.
func good() []byte {
	s := &stream{}
	s.header()
	s.start(map[string]uint64{ram: mem, bios: 64 << 10}, []string{ram, bios})
	s.endOfSection(0x02)
	s.page(ram, 0, false, page(1))
	s.page(ram, 4096, true, page(2))
	s.page(bios, 0, false, page(0xb))
	s.page(bios, 4096, true, []byte{0})
	s.page(ram, 8192, false, []byte{7})
	s.page(ram, 12288, true, []byte{0}) // never written: a hole
	s.page(ram, 16384, true, page(3))
	s.endOfSection(0x03)
	s.page(ram, 20480, true, page(4))   // continuing the block of the section before
	s.page(ram, 4096, false, []byte{0}) // saved again, zero now
	s.page(bios, 8192, false, page(0xc))
	s.endOfSection(0)
	s.b = append(s.b, devicesTail...)
	return s.b
}

func split(t *testing.T, in []byte) (devices, memory []byte, err error) {
	t.Helper()
	dir := t.TempDir()
	src := filepath.Join(dir, "state")
	if err := os.WriteFile(src, in, 0o600); err != nil {
		t.Fatal(err)
	}
	dev, memPath := filepath.Join(dir, "devices"), filepath.Join(dir, "memory")
	err = guestmem.Split(src, dev, memPath, ram, mem)
	if err != nil {
		for _, p := range []string{dev, memPath} {
			if _, serr := os.Stat(p); serr == nil {
				t.Errorf("a failed split left %s", filepath.Base(p))
			}
		}
		return nil, nil, err
	}
	devices, _ = os.ReadFile(dev)
	memory, _ = os.ReadFile(memPath)
	return devices, memory, nil
}

// TestSplit: the guest's RAM block becomes the memory file, page for page; the devices'
// stream keeps the other blocks' pages and the devices, lists every block with an address and
// says it was saved with x-ignore-shared.
func TestSplit(t *testing.T) {
	devices, memory, err := split(t, good())
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, mem)
	copy(want[0:], page(1))
	copy(want[8192:], page(7))
	copy(want[16384:], page(3))
	copy(want[20480:], page(4))
	if !bytes.Equal(memory, want) {
		t.Error("the memory file is not the guest's pages as saved last")
	}
	s := &stream{}
	s.header()
	caps := "\x05\x1aconfiguration/capabilities\x00\x00\x00\x01\x00\x00\x00\x01\x0fx-ignore-shared"
	s.b = append(s.b, caps...)
	s.u8(0x01)
	s.u32(2)
	s.str("ram")
	s.u32(0)
	s.u32(4)
	s.u64((mem + 64<<10) | 0x04)
	s.str(ram)
	s.u64(mem)
	s.u64(0)
	s.str(bios)
	s.u64(64 << 10)
	s.u64(0)
	s.endOfSection(0x02)
	s.page(bios, 0, false, page(0xb))
	s.page(bios, 4096, true, []byte{0})
	s.endOfSection(0x03)
	s.page(bios, 8192, true, page(0xc)) // the block the output's record before was of
	s.endOfSection(0)
	s.b = append(s.b, devicesTail...)
	if !bytes.Equal(devices, s.b) {
		i := 0
		for i < min(len(devices), len(s.b)) && devices[i] == s.b[i] {
			i++
		}
		t.Errorf("the devices' stream (%d bytes, want %d) differs at byte %d: got %q, want %q", len(devices), len(s.b), i,
			devices[max(0, i-16):min(len(devices), i+16)], s.b[max(0, i-16):min(len(s.b), i+16)])
	}
}

// TestSplitRefusesWhatAPausedGuestsSaveHasNot is the attack: a VMM writes a stream meant to
// make the agent write outside the memory file, take another block for the guest's, loop or
// allocate without bound. Each is refused and leaves no file.
func TestSplitRefusesWhatAPausedGuestsSaveHasNot(t *testing.T) {
	build := func(f func(s *stream)) []byte {
		s := &stream{}
		s.header()
		f(s)
		return s.b
	}
	blocks := map[string]uint64{ram: mem, bios: 64 << 10}
	order := []string{ram, bios}
	cases := map[string][]byte{
		"not a stream": []byte("not a migration stream at all"),
		"a page past its block": build(func(s *stream) {
			s.start(blocks, order)
			s.endOfSection(0x02)
			s.page(ram, mem, false, page(1))
		}),
		"a page of an unlisted block": build(func(s *stream) {
			s.start(blocks, order)
			s.endOfSection(0x02)
			s.page("other", 0, false, page(1))
		}),
		"a continued page before any block": build(func(s *stream) {
			s.start(blocks, order)
			s.endOfSection(0x02)
			s.page(ram, 0, true, page(1))
		}),
		"an XBZRLE page": build(func(s *stream) {
			s.start(blocks, order)
			s.endOfSection(0x02)
			s.u64(0x40)
			s.str(ram)
		}),
		"a guest RAM of another size": build(func(s *stream) {
			s.start(map[string]uint64{ram: 2 * mem}, []string{ram})
		}),
		"no guest RAM": build(func(s *stream) {
			s.start(map[string]uint64{bios: 64 << 10}, []string{bios})
			s.endOfSection(0)
			s.b = append(s.b, devicesTail...)
		}),
		"a block listed twice": build(func(s *stream) {
			s.start(map[string]uint64{ram: mem}, []string{ram, ram})
		}),
		"blocks beyond any guest": build(func(s *stream) {
			s.u8(0x01)
			s.u32(2)
			s.str("ram")
			s.u32(0)
			s.u32(4)
			s.u64(1<<62 | 0x04)
		}),
		"a section of another id in the RAM's place": build(func(s *stream) {
			s.start(blocks, order)
			s.u64(0x10)
			s.u8(0x7e)
			s.u32(9)
		}),
		"a truncated page": build(func(s *stream) {
			s.start(blocks, order)
			s.endOfSection(0x02)
			s.page(ram, 0, false, page(1)[:100])
		}),
		"capabilities already set": build(func(s *stream) {
			s.b = append(s.b, 0x05)
		}),
		"devices past their bound": build(func(s *stream) {
			s.start(blocks, order)
			s.endOfSection(0)
			s.b = append(s.b, 0x04)
			s.b = append(s.b, make([]byte, 65<<20)...)
		}),
	}
	for name, in := range cases {
		t.Run(strings.ReplaceAll(name, " ", "_"), func(t *testing.T) {
			if _, _, err := split(t, in); err == nil {
				t.Errorf("%s: split", name)
			}
		})
	}
}
