package guestsession

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
)

// KeysPath is the request that gives the OS's users their SSH public keys (a VM of boot OS,
// spec.accessCredentials): the request's body is AuthorizedKeys as JSON, the answer's
// KeysResult.
const KeysPath = "/keys"

// MaxKeysBody bounds the request's body.
const MaxKeysBody = 1 << 20

// AuthorizedKeys are the authorized_keys lines of each user; a user with none has IMP's block
// of its file emptied.
type AuthorizedKeys map[string][]string

// KeysResult says which users the OS does not have yet: their keys are written once they
// exist, at a later request.
type KeysResult struct {
	Pending []string `json:"pending,omitempty"`
}

// Keys gives the guest's users their keys and returns the users it does not have yet.
func (c *Client) Keys(ctx context.Context, keys AuthorizedKeys) ([]string, error) {
	body, err := json.Marshal(keys)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://guest"+KeysPath, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set(TokenHeader, c.token)
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("giving the guest its SSH keys: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("the guest refused its SSH keys: %s", statusText(resp))
	}
	var res KeysResult
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&res); err != nil {
		return nil, fmt.Errorf("the guest's answer to its SSH keys: %w", err)
	}
	return res.Pending, nil
}

// keys answers KeysPath with the server's Keys, when it has one (an OS's guest side).
func (s *Server) keys(w http.ResponseWriter, r *http.Request) {
	if s.Keys == nil {
		http.Error(w, "this guest does not boot an OS: it has no users to give keys to", http.StatusNotFound)
		return
	}
	var keys AuthorizedKeys
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, MaxKeysBody)).Decode(&keys); err != nil {
		http.Error(w, "decoding the keys: "+err.Error(), http.StatusBadRequest)
		return
	}
	pending, err := s.Keys(keys)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(KeysResult{Pending: pending})
}
