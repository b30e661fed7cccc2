package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
)

// localPathHelper is the command of local-path-provisioner's helper pods on the e2e's real node
// (its setupCommand and teardownCommand: hack/real-node.sh), in place of the busybox script of its
// stock configuration: `-p DIR -s SIZE -m MODE -a create|delete` makes the volume's directory
// (mode 0777, as the stock script does) or removes it. The provisioner chooses DIR under the
// node path it is configured with; this refuses anything that is not absolute and clean.
func localPathHelper(args []string) error {
	fs := flag.NewFlagSet("local-path-helper", flag.ContinueOnError)
	path := fs.String("p", "", "the volume's directory")
	fs.String("s", "", "the volume's size in bytes (unused: a directory has none)")
	fs.String("m", "", "the volume mode (Filesystem)")
	action := fs.String("a", "", "create or delete")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if !filepath.IsAbs(*path) || filepath.Clean(*path) != *path || *path == "/" {
		return fmt.Errorf("local-path helper: the path %q is not an absolute, clean directory", *path)
	}
	switch *action {
	case "create":
		if err := os.MkdirAll(*path, 0o777); err != nil {
			return err
		}
		return os.Chmod(*path, 0o777) // as mkdir -m 0777: not lowered by the umask
	case "delete":
		return os.RemoveAll(*path)
	}
	return fmt.Errorf("local-path helper: unknown action %q (create or delete)", *action)
}
