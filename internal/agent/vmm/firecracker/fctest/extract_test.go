package fctest

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

var update = flag.Bool("update", false, "rewrite testdata/api.json from the definition")

// definitionPath finds Firecracker's firecracker.yaml: $FIRECRACKER_API_DEFINITION, or the
// reference copy beside the repository on IMP's development machines.
func definitionPath() string {
	if p := os.Getenv("FIRECRACKER_API_DEFINITION"); p != "" {
		return p
	}
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(file), "../../../../..")
	return filepath.Join(root, "../shared/reference/firecracker-v1.16.1/firecracker.yaml")
}

// derive builds the extract from the definition for the paths in want.
func derive(t *testing.T, data []byte, paths map[string]map[string]string) *API {
	var spec struct {
		Info  struct{ Version string }
		Paths map[string]map[string]struct {
			Parameters []struct {
				In     string
				Schema map[string]any
			}
		}
		Definitions map[string]map[string]any
	}
	if err := yaml.Unmarshal(data, &spec); err != nil {
		t.Fatal(err)
	}
	a := &API{Version: spec.Info.Version, Paths: map[string]map[string]string{}, Definitions: map[string]Definition{}}
	refName := func(s map[string]any) string {
		r, _ := s["$ref"].(string)
		return strings.TrimPrefix(r, "#/definitions/")
	}
	for p, methods := range paths {
		ops, ok := spec.Paths[p]
		if !ok {
			t.Errorf("the definition has no path %s", p)
			continue
		}
		a.Paths[p] = map[string]string{}
		for m := range methods {
			op, ok := ops[m]
			if !ok {
				t.Errorf("the definition has no %s %s", strings.ToUpper(m), p)
				continue
			}
			def := ""
			for _, prm := range op.Parameters {
				if prm.In == "body" {
					def = refName(prm.Schema)
				}
			}
			a.Paths[p][m] = def
			if def == "" {
				continue
			}
			raw := spec.Definitions[def]
			d := Definition{Properties: map[string]string{}, Enums: map[string][]string{}}
			req, _ := raw["required"].([]any)
			for _, r := range req {
				d.Required = append(d.Required, r.(string))
			}
			sort.Strings(d.Required)
			props, _ := raw["properties"].(map[string]any)
			for name, v := range props {
				pv := v.(map[string]any)
				if ref := refName(pv); ref != "" {
					pv = spec.Definitions[ref]
				}
				typ, _ := pv["type"].(string)
				if typ == "" {
					typ = "object"
				}
				d.Properties[name] = typ
				if enum, ok := pv["enum"].([]any); ok {
					for _, e := range enum {
						d.Enums[name] = append(d.Enums[name], strings.TrimSpace(toString(e)))
					}
				}
			}
			if len(d.Enums) == 0 {
				d.Enums = nil
			}
			a.Definitions[def] = d
		}
	}
	return a
}

func toString(v any) string {
	b, _ := json.Marshal(v)
	return strings.Trim(string(b), `"`)
}

// TestExtractMatchesDefinition derives the double's extract from Firecracker's own definition
// and fails when they differ, so that the double cannot drift into agreeing with our bugs.
// Without the definition (it is not in this repository) it checks what it can offline.
func TestExtractMatchesDefinition(t *testing.T) {
	have, err := Extract()
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(definitionPath())
	if err != nil {
		t.Skipf("Firecracker's API definition not found (%v): set FIRECRACKER_API_DEFINITION to its firecracker.yaml", err)
	}
	want := derive(t, data, have.Paths)
	if *update {
		b, _ := json.MarshalIndent(want, "", "  ")
		if err := os.WriteFile("testdata/api.json", append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	a, _ := json.Marshal(have)
	b, _ := json.Marshal(want)
	if !bytes.Equal(a, b) {
		t.Errorf("testdata/api.json differs from %s; rerun with -update and review the diff", definitionPath())
	}
}
