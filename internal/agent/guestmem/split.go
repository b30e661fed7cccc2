package guestmem

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
)

// The parts of QEMU's migration stream (QEMU 7.2, migration/savevm.c and migration/ram.c) that
// Split reads: everything else is copied as it is.
const (
	streamMagic   = 0x5145564d // "QEVM"
	streamVersion = 3

	sectionEOF           = 0x00
	sectionStart         = 0x01
	sectionPart          = 0x02
	sectionEnd           = 0x03
	sectionFull          = 0x04
	sectionSubsection    = 0x05
	sectionConfiguration = 0x07
	sectionFooter        = 0x7e

	// Flags in the low bits of a RAM record's offset.
	ramZero     = 0x02 // a page of one byte value
	ramMemSize  = 0x04 // the RAM blocks' list
	ramPage     = 0x08 // a whole page
	ramEOS      = 0x10 // the end of a RAM section
	ramContinue = 0x20 // the same block as the record before
	ramFlags    = 0xfff

	pageSize = 4096
	// maxBlocks bounds the RAM blocks of a stream: microvm has five.
	maxBlocks = 64
	// maxDevices bounds the devices' stream Split writes: a guest's has about 70 KiB, and
	// microvm's ROMs and firmware a few hundred more.
	maxDevices = 64 << 20
)

// ignoreSharedCaps is the configuration's capabilities subsection of a stream saved with
// x-ignore-shared: QEMU compares it with the loading side's capabilities.
var ignoreSharedCaps = func() []byte {
	id, capName := "configuration/capabilities", "x-ignore-shared"
	b := []byte{sectionSubsection, byte(len(id))}
	b = append(b, id...)
	b = binary.BigEndian.AppendUint32(b, 1) // the subsection's version
	b = binary.BigEndian.AppendUint32(b, 1) // one capability
	b = append(b, byte(len(capName)))
	return append(b, capName...)
}()

// Split turns stream, the migration stream a VMM saved of a paused guest (its memory and its
// devices), into devices, the same stream without the pages of the RAM block ramID (as QEMU
// saves it with x-ignore-shared), and memory, that block's contents page for page (sparse: a
// zero page is a hole), which must be memBytes long. It is how a snapshot's memory becomes a
// file that a restore fills a VM's memory with, instead of QEMU loading it page by page.
//
// The stream is the VMM's, so hostile: every length and offset is bounded, and only the record
// kinds a paused guest's save has are taken; anything else is an error, and the caller keeps
// the stream as it is. Split writes both outputs new (0600) and removes them on error.
func Split(stream, devices, memory, ramID string, memBytes int64) (err error) {
	if memBytes <= 0 || memBytes%pageSize != 0 {
		return fmt.Errorf("a guest memory of %d bytes", memBytes)
	}
	in, err := os.OpenFile(stream, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	var outs []*os.File
	defer func() {
		for _, f := range outs {
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				_ = os.Remove(f.Name())
			}
		}
	}()
	create := func(path string) (*os.File, error) {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
		if err == nil {
			outs = append(outs, f)
		}
		return f, err
	}
	devOut, err := create(devices)
	if err != nil {
		return err
	}
	memOut, err := create(memory)
	if err != nil {
		return err
	}
	// The stream as it is now: its VMM may still hold a descriptor of it to write more.
	r := bufio.NewReaderSize(io.LimitReader(in, fi.Size()), 1<<20)
	w := bufio.NewWriterSize(&limitWriter{w: devOut, n: maxDevices}, 256<<10)
	s := &splitter{r: r, w: w, ram: ramID, memBytes: memBytes,
		mem: &pageWriter{f: memOut, written: make([]uint64, (memBytes/pageSize+63)/64)}}
	if err := s.run(); err != nil {
		return fmt.Errorf("splitting the guest's memory out of its saved state: %w", err)
	}
	if err := s.mem.flush(); err != nil {
		return err
	}
	if err := memOut.Truncate(memBytes); err != nil {
		return err
	}
	if err := w.Flush(); err != nil {
		return err
	}
	return errors.Join(devOut.Sync(), memOut.Sync())
}

type splitter struct {
	r        *bufio.Reader
	w        *bufio.Writer
	ram      string
	memBytes int64
	mem      *pageWriter
	// blocks are the stream's RAM blocks and their lengths; ramSeen that ram is one of them.
	blocks  map[string]uint64
	ramSeen bool
	section uint32 // the RAM section's id
	// cur is the block of the input's record before, which a record that continues it is of,
	// and out the output's: QEMU continues blocks across sections.
	cur, out string
}

func (s *splitter) run() error {
	if magic, err := s.u32(); err != nil || magic != streamMagic {
		return fmt.Errorf("not a migration stream (%w)", err)
	}
	if v, err := s.u32(); err != nil || v != streamVersion {
		return fmt.Errorf("migration stream version %d, not %d (%w)", v, streamVersion, err)
	}
	s.put32(streamMagic)
	s.put32(streamVersion)
	if err := s.configuration(); err != nil {
		return err
	}
	for {
		kind, err := s.r.ReadByte()
		if err != nil {
			return err
		}
		switch kind {
		case sectionStart:
			isRAM, err := s.startHeader()
			if err != nil {
				return err
			}
			if !isRAM {
				return s.rest()
			}
			if err := s.memSize(); err != nil {
				return err
			}
		case sectionPart, sectionEnd:
			s.w.WriteByte(kind)
			id, err := s.u32()
			if err != nil {
				return err
			}
			if id != s.section || s.blocks == nil {
				return fmt.Errorf("a section %d in the RAM's place", id)
			}
			s.put32(id)
		case sectionFull, sectionEOF:
			if !s.ramSeen {
				return fmt.Errorf("no RAM block %s in the stream", s.ram)
			}
			s.w.WriteByte(kind)
			return s.rest()
		default:
			return fmt.Errorf("an unexpected section kind %#x", kind)
		}
		if err := s.pages(); err != nil {
			return err
		}
		if err := s.footer(); err != nil {
			return err
		}
	}
}

// configuration copies the configuration section (the machine's name), adding the
// x-ignore-shared capability that the devices' stream is saved with.
func (s *splitter) configuration() error {
	kind, err := s.r.ReadByte()
	if err != nil || kind != sectionConfiguration {
		return fmt.Errorf("no configuration section (%#x, %w)", kind, err)
	}
	n, err := s.u32()
	if err != nil || n > 256 {
		return fmt.Errorf("a machine name of %d bytes (%w)", n, err)
	}
	name := make([]byte, n)
	if _, err := io.ReadFull(s.r, name); err != nil {
		return err
	}
	if next, err := s.r.Peek(1); err != nil || next[0] == sectionSubsection {
		return fmt.Errorf("a configuration with subsections (capabilities already set) (%w)", err)
	}
	s.w.WriteByte(sectionConfiguration)
	s.put32(n)
	s.w.Write(name)
	s.w.Write(ignoreSharedCaps)
	return nil
}

// startHeader reads a section start's header. It copies it and returns true for the RAM
// section; another section is put back into the output for rest.
func (s *splitter) startHeader() (bool, error) {
	id, err := s.u32()
	if err != nil {
		return false, err
	}
	idstr, err := s.str()
	if err != nil {
		return false, err
	}
	inst, err := s.u32()
	if err != nil {
		return false, err
	}
	ver, err := s.u32()
	if err != nil {
		return false, err
	}
	s.w.WriteByte(sectionStart)
	s.put32(id)
	s.putStr(idstr)
	s.put32(inst)
	s.put32(ver)
	if idstr != "ram" {
		return false, nil
	}
	if s.blocks != nil {
		return false, errors.New("a second RAM section")
	}
	s.section = id
	return true, nil
}

// memSize reads the RAM blocks' list and writes it as x-ignore-shared has it: each block with
// its address. Only the ignored block's is checked on loading; microvm's RAM is at 0.
func (s *splitter) memSize() error {
	word, err := s.u64()
	if err != nil {
		return err
	}
	if word&ramFlags != ramMemSize {
		return fmt.Errorf("a RAM section starting with flags %#x", word&ramFlags)
	}
	total := word &^ ramFlags
	if total > uint64(s.memBytes)+1<<30 {
		return fmt.Errorf("%d bytes of RAM blocks for a guest of %d", total, s.memBytes)
	}
	s.put64(word)
	s.blocks = map[string]uint64{}
	for total > 0 {
		if len(s.blocks) == maxBlocks {
			return errors.New("too many RAM blocks")
		}
		id, err := s.str()
		if err != nil {
			return err
		}
		n, err := s.u64()
		if err != nil {
			return err
		}
		if n > total || n%pageSize != 0 {
			return fmt.Errorf("RAM block %s of %d bytes", id, n)
		}
		if _, dup := s.blocks[id]; dup {
			return fmt.Errorf("RAM block %s twice", id)
		}
		if id == s.ram {
			if n != uint64(s.memBytes) {
				return fmt.Errorf("RAM block %s is %d bytes, not the guest's %d", id, n, s.memBytes)
			}
			s.ramSeen = true
		}
		s.blocks[id] = n
		total -= n
		s.putStr(id)
		s.put64(n)
		s.put64(0) // the address
	}
	return nil
}

// pages reads a RAM section's records up to its end: pages of the guest's RAM block go into
// the memory file, others stay in the stream.
func (s *splitter) pages() error {
	for {
		word, err := s.u64()
		if err != nil {
			return err
		}
		flags, off := word&ramFlags, word&^ramFlags
		if flags == ramEOS {
			s.put64(word)
			return nil
		}
		if flags&^ramContinue != ramPage && flags&^ramContinue != ramZero {
			return fmt.Errorf("a RAM record with flags %#x", flags)
		}
		if flags&ramContinue == 0 {
			if s.cur, err = s.str(); err != nil {
				return err
			}
		}
		cur := s.cur
		n, ok := s.blocks[cur]
		if !ok {
			return fmt.Errorf("a page of RAM block %q, which the stream did not list", cur)
		}
		if off >= n {
			return fmt.Errorf("a page at %#x of RAM block %s of %d bytes", off, cur, n)
		}
		var page []byte
		if flags&ramPage != 0 {
			if page, err = s.r.Peek(pageSize); err != nil {
				return err
			}
		} else {
			fill, err := s.r.Peek(1)
			if err != nil {
				return err
			}
			page = fill
		}
		if cur == s.ram {
			if err := s.mem.page(int64(off), page); err != nil {
				return err
			}
		} else {
			f := flags &^ ramContinue
			if s.out == cur {
				f |= ramContinue
			}
			s.put64(off | f)
			if s.out != cur {
				s.putStr(cur)
			}
			s.w.Write(page)
			s.out = cur
		}
		if _, err := s.r.Discard(len(page)); err != nil {
			return err
		}
	}
}

func (s *splitter) footer() error {
	kind, err := s.r.ReadByte()
	if err != nil || kind != sectionFooter {
		return fmt.Errorf("no section footer (%#x, %w)", kind, err)
	}
	id, err := s.u32()
	if err != nil || id != s.section {
		return fmt.Errorf("the footer of section %d in section %d's place (%w)", id, s.section, err)
	}
	s.w.WriteByte(sectionFooter)
	s.put32(id)
	return nil
}

// rest copies the stream's remainder, the devices, as it is.
func (s *splitter) rest() error {
	if !s.ramSeen {
		return fmt.Errorf("no RAM block %s in the stream", s.ram)
	}
	_, err := io.Copy(s.w, s.r)
	return err
}

func (s *splitter) u32() (uint32, error) {
	var b [4]byte
	_, err := io.ReadFull(s.r, b[:])
	return binary.BigEndian.Uint32(b[:]), err
}

func (s *splitter) u64() (uint64, error) {
	var b [8]byte
	_, err := io.ReadFull(s.r, b[:])
	return binary.BigEndian.Uint64(b[:]), err
}

func (s *splitter) str() (string, error) {
	n, err := s.r.ReadByte()
	if err != nil {
		return "", err
	}
	b := make([]byte, n)
	_, err = io.ReadFull(s.r, b)
	return string(b), err
}

func (s *splitter) put32(v uint32) { s.w.Write(binary.BigEndian.AppendUint32(nil, v)) }
func (s *splitter) put64(v uint64) { s.w.Write(binary.BigEndian.AppendUint64(nil, v)) }
func (s *splitter) putStr(v string) {
	s.w.WriteByte(byte(len(v)))
	s.w.WriteString(v)
}

// limitWriter fails a write past its n bytes.
type limitWriter struct {
	w io.Writer
	n int64
}

func (l *limitWriter) Write(p []byte) (int, error) {
	if int64(len(p)) > l.n {
		return 0, fmt.Errorf("the devices' stream is over %d bytes", maxDevices)
	}
	l.n -= int64(len(p))
	return l.w.Write(p)
}

// pageWriter writes the guest's pages into the memory file: runs of consecutive pages in one
// write, zero pages as holes unless a page there was written before (a page saved again).
type pageWriter struct {
	f       *os.File
	written []uint64 // a bit per page
	runOff  int64
	run     []byte
}

// page writes the page at off: data of a page's size, or one byte the page is full of.
func (p *pageWriter) page(off int64, data []byte) error {
	i := off / pageSize
	was := p.written[i/64]&(1<<(i%64)) != 0
	if len(data) == 1 {
		if data[0] == 0 && !was {
			return nil // a hole
		}
		data = bytes.Repeat(data, pageSize)
	}
	p.written[i/64] |= 1 << (i % 64)
	if off != p.runOff+int64(len(p.run)) || len(p.run) >= 1<<20 || was {
		if err := p.flush(); err != nil {
			return err
		}
		p.runOff = off
	}
	p.run = append(p.run, data...)
	return nil
}

func (p *pageWriter) flush() error {
	if len(p.run) == 0 {
		return nil
	}
	_, err := p.f.WriteAt(p.run, p.runOff)
	p.run = p.run[:0]
	return err
}
