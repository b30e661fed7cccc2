package disk

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/syscode-labs/imp/internal/testregistry"
)

// TestAnImpostorRegistryGetsNoDisk: tenant A's private image has its base disk on the node.
// Tenant B names its digest at a registry of B's own, which answers every manifest request
// with that digest and A's manifest and config (as if they had leaked), but cannot serve A's
// layers: by digest and by a tag that resolves to it, B is refused, however often it asks.
// A mirror that holds the bytes passes, and joins the disk's provenance, so that it costs no
// layer again; A's own registry, after a restart of the store, costs the manifest and config.
func TestAnImpostorRegistryGetsNoDisk(t *testing.T) {
	requireTools(t)
	host, requests := countedRegistry(t, "puller", "s3cret")
	auth := base64.StdEncoding.EncodeToString([]byte("puller:s3cret"))
	a, err := NewPullSecretKeychain([]byte(fmt.Sprintf(`{"auths":{"http://%s/v2/":{"auth":%q}}}`, host, auth)))
	if err != nil {
		t.Fatal(err)
	}
	d := testregistry.Push(t, host, "private", a, layer(t, file("secret", "tenant A's data\n")))
	ctx := context.Background()
	dir := t.TempDir()
	store := &BaseStore{Dir: dir, MaxBytes: 1 << 30}
	if _, _, err := store.Ensure(ctx, "team", d, a); err != nil {
		t.Fatal(err)
	}
	if err := store.Authorize(ctx, d, a); err != nil {
		t.Fatalf("the credentials that built the disk: %v", err)
	}

	impostor, asked := testregistry.StartImpostor(t, d, a)
	byDigest, err := name.NewDigest(impostor+"/x@"+d.DigestStr(), name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	tag, err := name.NewTag(impostor+"/x:latest", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := store.Authorize(ctx, byDigest, anonymous); err == nil {
			t.Fatalf("try %d: the impostor's reference by digest was authorized", i)
		} else if !strings.Contains(err.Error(), "does not serve the image's content") {
			t.Errorf("try %d: refused for another reason than the content: %v", i, err)
		}
		resolved, err := store.Resolve(ctx, tag, anonymous)
		if err != nil || resolved.DigestStr() != d.DigestStr() {
			t.Fatalf("the impostor's tag resolved to %v, %v; want A's digest (what the attack relies on)", resolved, err)
		}
		store.Verified(resolved, anonymous) // what the agent does after resolving a tag
		if err := store.Authorize(ctx, resolved, anonymous); err == nil {
			t.Fatalf("try %d: the impostor's tag was authorized", i)
		}
	}
	if asked.Load() == 0 {
		t.Fatal("the impostor was never asked")
	}
	if repos, _ := store.provenance(d); len(repos) != 1 || repos[0] != d.Context().Name() {
		t.Errorf("provenance %q, want A's repository alone", repos)
	}

	// A mirror with the bytes: proven once, by pulling them.
	mirror := testregistry.Start(t, "", "")
	mirrored, err := name.NewDigest(mirror+"/copy@"+d.DigestStr(), name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	img, err := remote.Image(d, remote.WithAuthFromKeychain(a))
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(mirrored, img); err != nil {
		t.Fatal(err)
	}
	if err := store.Authorize(ctx, mirrored, anonymous); err != nil {
		t.Fatalf("a mirror holding the image: %v", err)
	}
	if repos, _ := store.provenance(d); len(repos) != 2 {
		t.Errorf("provenance %q, want A's repository and the mirror", repos)
	}

	// Restarted (the proofs are in memory, the provenance on disk): A's registry costs the
	// manifest and the config, not the layer; the impostor is still refused.
	store = &BaseStore{Dir: dir, MaxBytes: 1 << 30}
	n := requests.Load()
	if err := store.Authorize(ctx, d, a); err != nil {
		t.Fatal(err)
	}
	if got := requests.Load() - n; got > 3 {
		t.Errorf("proving A's access again at its own repository took %d requests, want the ping, manifest and config", got)
	}
	if err := store.Authorize(ctx, byDigest, anonymous); err == nil {
		t.Error("after a restart, the impostor was authorized")
	}
	if _, err := os.Stat(store.provenancePath(d)); err != nil {
		t.Errorf("no provenance beside the disk: %v", err)
	}
}
