// Package accesskeys resolves a VM's spec.accessCredentials into the authorized_keys lines each
// user of its OS gets (docs/os.md, "SSH keys"). The operator alone reads the Secrets they name,
// of the VM's namespace, and carries the keys to the node in the VM's run Secret (key SecretKey);
// the node's agent gives them to the guest side, which writes them.
package accesskeys

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	"golang.org/x/crypto/ssh"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// SecretKey is the key of a VM's run Secret that carries its keys, as JSON.
const SecretKey = "ssh.keys"

// Bounds of what a VM's users are given: a Secret's line or all of them past these is an
// error, not a truncation.
const (
	MaxLine  = 16 << 10
	MaxLines = 256
	// MaxBytes bounds the lines of all users together, as the guest is sent them (the guest
	// side takes a request of 1 MiB at most).
	MaxBytes = 256 << 10
)

// None are no keys: what a VM that names no credentials any more gives its guest, whose users
// given keys before lose them.
var None = Keys{}

// Keys are the authorized_keys lines of each user, sorted and without duplicates.
type Keys map[string][]string

// Digest is the SHA-256 of the keys, in hex: what they are, whatever the order of the
// Secrets and users that gave them.
func (k Keys) Digest() string {
	b, _ := json.Marshal(k) // a map's keys are marshalled sorted; each user's lines are sorted
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// Encode is the keys as the run Secret carries them.
func (k Keys) Encode() []byte {
	b, _ := json.Marshal(k)
	return b
}

// Decode reads what Encode wrote.
func Decode(b []byte) (Keys, error) {
	var k Keys
	if err := json.Unmarshal(b, &k); err != nil {
		return nil, fmt.Errorf("decoding the SSH keys of the run's Secret: %w", err)
	}
	if k == nil {
		k = Keys{}
	}
	return k, nil
}

// Resolve reads the Secrets vm's accessCredentials name, from its namespace, with r (an
// uncached reader). A Secret that is not there gives no keys, and is named in missing (its
// users lose the keys it gave: deleting the Secret revokes them); any other failure to read
// is an error, and nothing is resolved. A line that is not an authorized key is an error.
func Resolve(ctx context.Context, r client.Reader, vm *impv1.ImpVM) (keys Keys, missing []string, err error) {
	keys = Keys{}
	total := 0
	for i, c := range vm.Spec.AccessCredentials {
		for _, u := range c.Users {
			if keys[u] == nil {
				keys[u] = []string{} // named: a user given no keys has its block emptied
			}
		}
		name := c.SSHPublicKeys.SecretName
		var s corev1.Secret
		switch err := r.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: name}, &s); {
		case apierrors.IsNotFound(err):
			missing = append(missing, fmt.Sprintf("accessCredentials[%d]: Secret %s in namespace %s not found", i, name, vm.Namespace))
			continue
		case err != nil:
			return nil, nil, fmt.Errorf("accessCredentials[%d]: reading Secret %s in namespace %s: %w", i, name, vm.Namespace, err)
		}
		lines, err := Lines(s.Data)
		if err != nil {
			return nil, nil, fmt.Errorf("accessCredentials[%d]: Secret %s in namespace %s: %w", i, name, vm.Namespace, err)
		}
		n := 0
		for _, l := range lines {
			n += len(l) + 1
		}
		if total += n * len(c.Users); total > MaxBytes {
			return nil, nil, fmt.Errorf("accessCredentials: the keys of all users come to more than %d bytes", MaxBytes)
		}
		for _, u := range c.Users {
			keys[u] = append(keys[u], lines...)
		}
	}
	for u, ls := range keys {
		slices.Sort(ls)
		keys[u] = slices.Compact(ls)
		if len(keys[u]) > MaxLines {
			return nil, nil, fmt.Errorf("accessCredentials: user %s would get %d keys, more than %d", u, len(keys[u]), MaxLines)
		}
	}
	return keys, missing, nil
}

// Lines are the authorized_keys lines of a Secret's data, each of its values one or more
// lines; blank lines and comments are left out. Each line must parse as an authorized key
// (its options, key type, key and comment), so that nothing but keys reaches the guest's
// files.
func Lines(data map[string][]byte) ([]string, error) {
	names := make([]string, 0, len(data))
	for k := range data {
		names = append(names, k)
	}
	slices.Sort(names)
	var out []string
	for _, k := range names {
		sc := bufio.NewScanner(bytes.NewReader(data[k]))
		sc.Buffer(make([]byte, 0, 4096), MaxLine)
		for n := 1; sc.Scan(); n++ {
			line := strings.TrimSpace(sc.Text())
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			if strings.ContainsAny(line, "\x00\r") {
				return nil, fmt.Errorf("key %s, line %d: a control character", k, n)
			}
			if _, _, _, rest, err := ssh.ParseAuthorizedKey([]byte(line)); err != nil {
				return nil, fmt.Errorf("key %s, line %d: not an SSH public key: %w", k, n, err)
			} else if len(rest) > 0 {
				return nil, fmt.Errorf("key %s, line %d: more than one key on the line", k, n)
			}
			out = append(out, line)
			if len(out) > MaxLines {
				return nil, fmt.Errorf("more than %d keys", MaxLines)
			}
		}
		if err := sc.Err(); err != nil {
			return nil, fmt.Errorf("key %s: %w", k, err)
		}
	}
	return out, nil
}
