package monitor

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/syscode-labs/imp/internal/agent/vmmdriver"
)

// consoleWriteTimeout bounds one write to a console's input: a guest that reads none of it
// ends the writer's attachment, and holds nothing of the agent's longer.
const consoleWriteTimeout = 10 * time.Second

// console is a run's serial console input, which everyone attached to the run shares: QEMU
// serves one connection at a time. It is opened with the first attachment and closed with
// the last, or when the run ends.
type console struct {
	open    func() (vmmdriver.ConsoleWriter, error)
	timeout time.Duration // consoleWriteTimeout if zero

	mu    sync.Mutex
	w     vmmdriver.ConsoleWriter
	users int
	ended bool
}

// write writes p to the console's input, opening it if need be.
func (c *console) write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ended {
		return 0, ErrNotRunning
	}
	if c.w == nil {
		w, err := c.open()
		if err != nil {
			return 0, fmt.Errorf("opening the VM's console: %w", err)
		}
		c.w = w
	}
	timeout := cmp.Or(c.timeout, consoleWriteTimeout)
	_ = c.w.SetWriteDeadline(time.Now().Add(timeout))
	n, err := c.w.Write(p)
	if err != nil {
		_ = c.w.Close()
		c.w = nil
		if errors.Is(err, os.ErrDeadlineExceeded) {
			err = fmt.Errorf("the guest read nothing of its console for %v", timeout)
		}
		return n, err
	}
	return n, nil
}

func (c *console) attach() {
	c.mu.Lock()
	c.users++
	c.mu.Unlock()
}

func (c *console) detach() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.users--; c.users == 0 && c.w != nil {
		_ = c.w.Close()
		c.w = nil
	}
}

// end closes the input for good: the run ended.
func (c *console) end() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ended = true
	if c.w != nil {
		_ = c.w.Close()
		c.w = nil
	}
}

// consoleInput is one attachment to a run's console.
type consoleInput struct {
	c    *console
	once sync.Once
}

func (i *consoleInput) Write(p []byte) (int, error) { return i.c.write(p) }

func (i *consoleInput) Close() error {
	i.once.Do(i.c.detach)
	return nil
}
