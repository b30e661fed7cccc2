// Package fctest is a strict test double of Firecracker's API for the firecracker driver's
// tests: a unix-socket HTTP server that validates every body against the schemas of
// Firecracker's API definition (an extract of v1.16.1's, testdata/api.json), refuses calls in
// an order Firecracker refuses, and keeps the resulting VM configuration for tests to assert.
package fctest

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
)

// extract is what the double knows of Firecracker's API: for each path and method the body's
// definition, and for each definition its required properties and the type (and enum) of
// each property. TestExtractMatchesDefinition derives it from Firecracker's firecracker.yaml.
//
//go:embed testdata/api.json
var extractJSON []byte

// API is an extract of Firecracker's API definition.
type API struct {
	Version     string                       `json:"version"`
	Paths       map[string]map[string]string `json:"paths"` // path → method → body definition ("" for none)
	Definitions map[string]Definition        `json:"definitions"`
}

// Definition is one body schema: required properties, property types, enums.
type Definition struct {
	Required   []string            `json:"required,omitempty"`
	Properties map[string]string   `json:"properties"` // name → JSON type: string, integer, number, boolean, object, array
	Enums      map[string][]string `json:"enums,omitempty"`
}

// Extract returns the double's extract of the API definition.
func Extract() (*API, error) {
	var a API
	if err := json.Unmarshal(extractJSON, &a); err != nil {
		return nil, fmt.Errorf("parsing the API extract: %w", err)
	}
	return &a, nil
}

// Validate checks a JSON body against the named definition: no unknown property, every
// required one, each of its type and enum.
func (a *API) Validate(def string, body []byte) error {
	d, ok := a.Definitions[def]
	if !ok {
		return fmt.Errorf("no definition %s", def)
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(body, &obj); err != nil {
		return fmt.Errorf("the body is not a JSON object: %v", err)
	}
	var errs []string
	for _, r := range d.Required {
		if _, ok := obj[r]; !ok {
			errs = append(errs, fmt.Sprintf("missing required field %q", r))
		}
	}
	names := make([]string, 0, len(obj))
	for n := range obj {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		want, ok := d.Properties[n]
		if !ok {
			// serde's message, as Firecracker's API answers it.
			known := make([]string, 0, len(d.Properties))
			for p := range d.Properties {
				known = append(known, "`"+p+"`")
			}
			sort.Strings(known)
			errs = append(errs, fmt.Sprintf("unknown field `%s`, expected one of %s", n, strings.Join(known, ", ")))
			continue
		}
		if got := jsonType(obj[n]); got != want && !(want == "number" && got == "integer") {
			errs = append(errs, fmt.Sprintf("field %q: %s, want %s", n, got, want))
			continue
		}
		if enum := d.Enums[n]; len(enum) > 0 {
			var s string
			_ = json.Unmarshal(obj[n], &s)
			found := false
			for _, e := range enum {
				found = found || e == s
			}
			if !found {
				errs = append(errs, fmt.Sprintf("field %q: %q is not one of %v", n, s, enum))
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%s: %s", def, strings.Join(errs, "; "))
	}
	return nil
}

func jsonType(raw json.RawMessage) string {
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		return "invalid"
	}
	switch x := v.(type) {
	case string:
		return "string"
	case bool:
		return "boolean"
	case float64:
		if x == float64(int64(x)) && !strings.ContainsAny(string(raw), ".eE") {
			return "integer"
		}
		return "number"
	case []any:
		return "array"
	case map[string]any:
		return "object"
	case nil:
		return "null"
	}
	return "unknown"
}
