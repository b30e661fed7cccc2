package disk

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// Authorize answers whether the credentials of kc may pull image d, asking the registry (one
// manifest HEAD) only the first time those credentials ask for that digest while this store
// lives. A base disk on the node is no proof that a VM may read its image: another tenant's
// credentials may have pulled it, so a digest that is there needs the registry's word once per
// credential; after that, starting a VM of it needs no request at all. Credentials that
// resolved or pulled the digest have that word already (Resolve, Ensure).
func (s *BaseStore) Authorize(ctx context.Context, d name.Digest, kc authn.Keychain) error {
	key, err := credentialKey(d.Context(), kc)
	if err != nil {
		return err
	}
	if s.verified(d.DigestStr(), key) {
		return nil
	}
	p, err := s.puller(d.Context(), kc)
	if err != nil {
		return err
	}
	if _, err := p.Head(ctx, d); err != nil {
		return fmt.Errorf("checking access to %s: %w", d, err)
	}
	s.verify(d.DigestStr(), key)
	return nil
}

// Verified records that the credentials of kc pulled or resolved d.
func (s *BaseStore) Verified(d name.Digest, kc authn.Keychain) {
	if key, err := credentialKey(d.Context(), kc); err == nil {
		s.verify(d.DigestStr(), key)
	}
}

func (s *BaseStore) verified(digest, key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.access[digest][key]
}

func (s *BaseStore) verify(digest, key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.access == nil {
		s.access = map[string]map[string]bool{}
	}
	if s.access[digest] == nil {
		s.access[digest] = map[string]bool{}
	}
	s.access[digest][key] = true
}

// credentialKey names the credentials kc gives for d's registry (a hash of them; "anonymous"
// without any).
func credentialKey(repo name.Repository, kc authn.Keychain) (string, error) {
	a, err := kc.Resolve(repo)
	if err != nil {
		return "", fmt.Errorf("credentials for %s: %w", repo, err)
	}
	if a == authn.Anonymous {
		return "anonymous", nil
	}
	cfg, err := a.Authorization()
	if err != nil {
		return "", fmt.Errorf("credentials for %s: %w", repo, err)
	}
	data, _ := json.Marshal(cfg)
	sum := sha256.Sum256(append([]byte(repo.RegistryStr()+"\x00"), data...))
	return hex.EncodeToString(sum[:]), nil
}

// maxPullers bounds the registry sessions a store keeps (credentials × registries).
const maxPullers = 256

// puller returns the store's registry session for kc's credentials at repo's registry: a
// remote.Puller, which keeps what the registry's authentication took (its ping, a bearer
// token) for the requests after the first, so that resolving a tag again costs one request.
func (s *BaseStore) puller(repo name.Repository, kc authn.Keychain) (*remote.Puller, error) {
	key, err := credentialKey(repo, kc)
	if err != nil {
		return nil, err
	}
	key = repo.RegistryStr() + "\x00" + key // "anonymous" is per registry too
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.pullers[key]; p != nil {
		return p, nil
	}
	p, err := remote.NewPuller(append(s.RemoteOptions, remote.WithAuthFromKeychain(kc))...)
	if err != nil {
		return nil, err
	}
	if s.pullers == nil || len(s.pullers) >= maxPullers {
		s.pullers = map[string]*remote.Puller{} // the sessions are made again as needed
	}
	s.pullers[key] = p
	return p, nil
}

// configPath is where the config of image d is kept beside its base disk.
func (s *BaseStore) configPath(d name.Digest) string {
	return filepath.Join(s.Dir, "sha256-"+d.DigestStr()[len("sha256:"):]+".config.json")
}

// Config returns the config of image d: kept beside its base disk when the disk was built,
// fetched (and kept) otherwise. The digest pins it: the manifest names the config by digest,
// and the kept copy is the one that manifest named.
func (s *BaseStore) Config(ctx context.Context, d name.Digest, kc authn.Keychain) (*v1.Config, error) {
	if data, err := os.ReadFile(s.configPath(d)); err == nil {
		var cf v1.ConfigFile
		if err := json.Unmarshal(data, &cf); err == nil {
			return &cf.Config, nil
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	img, err := remote.Image(d, append(s.RemoteOptions, remote.WithContext(ctx), remote.WithAuthFromKeychain(kc))...)
	if err != nil {
		return nil, fmt.Errorf("pulling %s: %w", d, err)
	}
	cf, err := s.keepConfig(d, img)
	if err != nil {
		return nil, err
	}
	return &cf.Config, nil
}

// keepConfig writes the config of img, image d, beside its base disk.
func (s *BaseStore) keepConfig(d name.Digest, img v1.Image) (*v1.ConfigFile, error) {
	raw, err := img.RawConfigFile() // verified against the manifest's config digest
	if err != nil {
		return nil, fmt.Errorf("reading the config of %s: %w", d, err)
	}
	cf, err := v1.ParseConfigFile(bytes.NewReader(raw))
	if err != nil {
		return nil, fmt.Errorf("parsing the config of %s: %w", d, err)
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return nil, err
	}
	tmp, err := os.CreateTemp(s.Dir, ".config-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(raw); err != nil {
		tmp.Close()
		return nil, err
	}
	if err := tmp.Close(); err != nil {
		return nil, err
	}
	if err := os.Rename(tmp.Name(), s.configPath(d)); err != nil {
		return nil, err
	}
	return cf, nil
}
