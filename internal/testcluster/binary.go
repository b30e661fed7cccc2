package testcluster

import (
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sync"
	"testing"
)

// binaries are the programs Binary built, by package, once per test process.
var binaries sync.Map // package → *built

type built struct {
	once sync.Once
	path string
	err  error
}

// Binary builds the Go program pkg (an import path, e.g. github.com/syscode-labs/imp/cmd/imp-agent)
// once per test process and returns its path: tests that run IMP's binaries as processes, to
// kill them at a failpoint.
func Binary(t testing.TB, pkg string) string {
	t.Helper()
	v, _ := binaries.LoadOrStore(pkg, &built{})
	b := v.(*built)
	b.once.Do(func() {
		dir, err := os.MkdirTemp("", "imp-bin")
		if err != nil {
			b.err = err
			return
		}
		b.path = filepath.Join(dir, path.Base(pkg))
		if out, err := exec.Command("go", "build", "-o", b.path, pkg).CombinedOutput(); err != nil {
			b.err = fmt.Errorf("building %s: %v\n%s", pkg, err, out)
		}
	})
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.path
}
