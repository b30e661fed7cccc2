package disk

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// Authorize answers whether the credentials of kc may use image d's base disk, proving it
// once per (repository, credentials) while this store lives. A base disk on the node is no
// proof that a VM may read its image: another tenant's credentials may have pulled it. And a
// registry's word alone proves nothing either: the tenant names the registry, and one of its
// own answers any HEAD with any digest. So the proof is about the content:
//
//   - at a repository the disk's bytes came from (its provenance: the repository it was built
//     from, or one that served every byte since), the credentials must fetch the image's
//     manifest and config, both checked against the digest; that registry served the bytes,
//     so what it lets these credentials read is its word on its own content;
//   - at any other repository, the node pulls the image's manifest, config and every layer
//     again with these credentials and checks each against its digest. Only a repository that
//     holds the bytes passes, and becomes part of the disk's provenance.
//
// After that, starting a VM of the image with these credentials at that repository costs no
// request. Credentials that built the disk, or resolved a tag at a repository of its
// provenance, have the proof already (Ensure, Verified).
func (s *BaseStore) Authorize(ctx context.Context, d name.Digest, kc authn.Keychain) error {
	key, err := accessKey(d.Context(), kc)
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
	opts := append(s.RemoteOptions, remote.WithContext(ctx), remote.Reuse(p))
	img, err := remote.Image(d, opts...) // the manifest, checked against d
	if err != nil {
		return fmt.Errorf("checking access to %s: %w", d, err)
	}
	if _, err := img.RawConfigFile(); err != nil { // checked against the manifest
		return fmt.Errorf("checking access to %s: reading its config: %w", d, err)
	}
	proven, err := s.provenance(d)
	if err != nil {
		return err
	}
	if !slices.Contains(proven, d.Context().Name()) {
		if err := verifyLayers(img); err != nil {
			return fmt.Errorf("checking access to %s: %s does not serve the image's content: %w", d, d.Context().Name(), err)
		}
		if err := s.addProvenance(d); err != nil {
			return err
		}
	}
	s.verify(d.DigestStr(), key)
	return nil
}

// verifyLayers reads every layer of img as the registry serves it, checking each against its
// digest, and keeps nothing.
func verifyLayers(img v1.Image) error {
	layers, err := img.Layers()
	if err != nil {
		return fmt.Errorf("listing the layers: %w", err)
	}
	for i, l := range layers {
		rc, err := l.Compressed() // checks the digest when read to its end
		if err != nil {
			return fmt.Errorf("layer %d: %w", i, err)
		}
		_, err = io.Copy(io.Discard, rc)
		if cerr := rc.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("layer %d: %w", i, err)
		}
	}
	return nil
}

// Verified records that the credentials of kc reached d at its repository (a tag there
// resolved to it): that counts as the proof of Authorize only where that repository is part
// of the disk's provenance, whose registry is then the judge of who reads its content.
func (s *BaseStore) Verified(d name.Digest, kc authn.Keychain) {
	proven, err := s.provenance(d)
	if err != nil || !slices.Contains(proven, d.Context().Name()) {
		return
	}
	if key, err := accessKey(d.Context(), kc); err == nil {
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

// accessKey names the credentials of kc at repository repo: an access proven at one
// repository is worth nothing at another, anonymous access included.
func accessKey(repo name.Repository, kc authn.Keychain) (string, error) {
	cred, err := credentialKey(repo, kc)
	if err != nil {
		return "", err
	}
	return repo.Name() + "\x00" + cred, nil
}

// provenancePath is where the repositories that served image d's bytes are kept, beside its
// base disk: one "registry/repository" a line.
func (s *BaseStore) provenancePath(d name.Digest) string {
	return filepath.Join(s.Dir, "sha256-"+d.DigestStr()[len("sha256:"):]+".repos")
}

// provenance lists the repositories that served image d's bytes (none for a disk an older
// agent built, whose every repository must then prove the content).
func (s *BaseStore) provenance(d name.Digest) ([]string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.provenanceLocked(d)
}

// provenanceLocked reads the provenance file once per digest while the store lives (a tag's
// start asks on every run): kept in memory with it, dropped with its disk.
func (s *BaseStore) provenanceLocked(d name.Digest) ([]string, error) {
	if repos, ok := s.provs[d.DigestStr()]; ok {
		return repos, nil
	}
	data, err := os.ReadFile(s.provenancePath(d))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("reading the provenance of %s: %w", d.DigestStr(), err)
	}
	repos := strings.Fields(string(data))
	if s.provs == nil {
		s.provs = map[string][]string{}
	}
	s.provs[d.DigestStr()] = repos
	return repos, nil
}

// maxProvenance bounds the repositories kept per image: past it, the oldest is forgotten
// (its users prove the content again).
const maxProvenance = 64

// addProvenance records that d's repository served the image's bytes, beside its base disk.
func (s *BaseStore) addProvenance(d name.Digest) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	repos, err := s.provenanceLocked(d)
	if err != nil {
		return err
	}
	repo := d.Context().Name()
	if slices.Contains(repos, repo) {
		return nil
	}
	repos = append(slices.Clone(repos), repo) // the kept slice is the one readers hold
	if len(repos) > maxProvenance {
		repos = repos[len(repos)-maxProvenance:]
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return err
	}
	if err := writeFileAtomic(s.Dir, s.provenancePath(d), []byte(strings.Join(repos, "\n")+"\n")); err != nil {
		return err
	}
	s.provs[d.DigestStr()] = repos
	return nil
}

// writeFileAtomic writes data to path through a temporary file of dir and a rename, so that
// path is never seen half written.
func writeFileAtomic(dir, path string, data []byte) error {
	tmp, err := os.CreateTemp(dir, ".tmp-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
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
	if err := writeFileAtomic(s.Dir, s.configPath(d), raw); err != nil {
		return nil, err
	}
	return cf, nil
}
