package guestinit

import (
	"bytes"
	"encoding/binary"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestConfigDiskRoundTrip(t *testing.T) {
	for _, cfg := range []Config{
		{Argv: []string{"/bin/hello"}},
		{Argv: []string{"/bin/sh", "-c", "echo $SECRET"}, Env: []string{"SECRET=s3cr\x00t", "A=" + strings.Repeat("x", 5000)}, WorkingDir: "/srv", User: "1000:1000", Hostname: "vm"},
	} {
		b, err := EncodeConfigDisk(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if len(b)%4096 != 0 {
			t.Errorf("disk of %d bytes, not whole 4 KiB blocks", len(b))
		}
		got, err := DecodeConfigDisk(bytes.NewReader(b))
		if err != nil || !reflect.DeepEqual(got, cfg) {
			t.Errorf("round trip = %+v, %v; want %+v", got, err, cfg)
		}
	}
}

func TestConfigDiskRefuses(t *testing.T) {
	good, _ := EncodeConfigDisk(Config{Argv: []string{"/bin/true"}})
	withLength := func(n uint32) []byte {
		b := append([]byte{}, good...)
		binary.LittleEndian.PutUint32(b[len(ConfigMagic):], n)
		return b
	}
	noArgv, _ := EncodeConfigDisk(Config{Env: []string{"A=1"}})
	osWithArgv, _ := EncodeConfigDisk(Config{OS: true, Argv: []string{"/bin/sh"}})
	for _, tt := range []struct {
		name    string
		disk    []byte
		notDisk bool
	}{
		{"an ext4 disk", make([]byte, 8192), true},
		{"too short", []byte("IMPC"), true},
		{"a length past the bound", withLength(MaxConfigBytes + 1), false},
		{"a length past the device", withLength(8000), false},
		{"no command", noArgv, false},
		{"an OS's boot with a command", osWithArgv, false},
		{"not JSON", append([]byte(ConfigMagic+"\x03\x00\x00\x00{{{"), make([]byte, 100)...), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodeConfigDisk(bytes.NewReader(tt.disk))
			if err == nil || errors.Is(err, ErrNotConfigDisk) != tt.notDisk {
				t.Errorf("error %v; want one (not a configuration disk: %v)", err, tt.notDisk)
			}
		})
	}
	osBoot, _ := EncodeConfigDisk(Config{OS: true})
	if cfg, err := DecodeConfigDisk(bytes.NewReader(osBoot)); err != nil || !cfg.OS {
		t.Errorf("an OS's boot (no command): %+v, %v", cfg, err)
	}
	if _, err := EncodeConfigDisk(Config{Argv: []string{strings.Repeat("x", MaxConfigBytes)}}); err == nil {
		t.Error("encoded a configuration past the bound")
	}
}
