// Package failpoint lets tests crash a process at a named point of its work, to show that a
// crash there loses or leaks nothing. Crash(name) exits the process at once, running no
// deferred function, when the environment variable IMP_FAILPOINT named that point when the
// process started; otherwise it does nothing.
package failpoint

import "os"

// EnvVar names the failpoint a process crashes at.
const EnvVar = "IMP_FAILPOINT"

// ExitCode is the exit status of a process that crashed at its failpoint.
const ExitCode = 86

var armed = os.Getenv(EnvVar)

// Crash exits the process when name is its failpoint.
func Crash(name string) {
	if armed != "" && armed == name {
		os.Exit(ExitCode)
	}
}
