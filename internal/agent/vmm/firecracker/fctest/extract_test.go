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

var update = flag.Bool("update", false, "rewrite testdata/api.json and the definition excerpt from Firecracker's definition")

// excerptPath is the part of Firecracker's definition the double needs, kept in the
// repository so that the check always runs.
const excerptPath = "testdata/firecracker-v1.16.1-excerpt.yaml"

const excerptHeader = `# An excerpt of Firecracker v1.16.1's API definition (src/firecracker/swagger/firecracker.yaml):
# the paths IMP's Firecracker driver calls and the definitions they reference, unchanged.
# Copyright Amazon.com, Inc. or its affiliates. Licensed under the Apache License, Version 2.0
# (http://www.apache.org/licenses/LICENSE-2.0). Regenerate: go test ./internal/agent/vmm/firecracker/fctest
# -run TestExtractMatchesDefinition -update, with FIRECRACKER_API_DEFINITION set to the full file.
`

// definitionPath finds Firecracker's whole firecracker.yaml: $FIRECRACKER_API_DEFINITION, or
// the reference copy beside the repository on IMP's development machines; "" without either.
func definitionPath() string {
	if p := os.Getenv("FIRECRACKER_API_DEFINITION"); p != "" {
		return p
	}
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(file), "../../../../..")
	p := filepath.Join(root, "../shared/reference/firecracker-v1.16.1/firecracker.yaml")
	if _, err := os.Stat(p); err != nil {
		return ""
	}
	return p
}

// excerpt is the part of the definition data that paths (path → methods) use: the version,
// those operations whole, and every definition they reference, directly or not.
func excerpt(t *testing.T, data []byte, paths map[string]map[string]string) map[string]any {
	var spec map[string]any
	if err := yaml.Unmarshal(data, &spec); err != nil {
		t.Fatal(err)
	}
	defs, _ := spec["definitions"].(map[string]any)
	allPaths, _ := spec["paths"].(map[string]any)
	outPaths, outDefs := map[string]any{}, map[string]any{}
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			if r, ok := v["$ref"].(string); ok {
				name := strings.TrimPrefix(r, "#/definitions/")
				if _, seen := outDefs[name]; !seen && defs[name] != nil {
					outDefs[name] = defs[name]
					walk(defs[name])
				}
			}
			for _, e := range v {
				walk(e)
			}
		case []any:
			for _, e := range v {
				walk(e)
			}
		}
	}
	for p, methods := range paths {
		ops, _ := allPaths[p].(map[string]any)
		out := map[string]any{}
		for m := range methods {
			if op, ok := ops[m]; ok {
				out[m] = op
				walk(op)
			}
		}
		outPaths[p] = out
	}
	info, _ := spec["info"].(map[string]any)
	return map[string]any{"swagger": spec["swagger"], "info": map[string]any{"version": info["version"]}, "paths": outPaths, "definitions": outDefs}
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
// and fails when they differ, so that the double cannot drift into agreeing with our bugs. The
// excerpt of the definition it derives from is in the repository; where the whole definition
// is at hand too, the excerpt must be exactly its part.
func TestExtractMatchesDefinition(t *testing.T) {
	have, err := Extract()
	if err != nil {
		t.Fatal(err)
	}
	if full := definitionPath(); full != "" {
		data, err := os.ReadFile(full)
		if err != nil {
			t.Fatal(err)
		}
		want, err := yaml.Marshal(excerpt(t, data, have.Paths))
		if err != nil {
			t.Fatal(err)
		}
		if *update {
			if err := os.WriteFile(excerptPath, append([]byte(excerptHeader), want...), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		kept, err := os.ReadFile(excerptPath)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(bytes.TrimPrefix(kept, []byte(excerptHeader)), want) {
			t.Errorf("%s is not the part of %s the double uses; rerun with -update and review the diff", excerptPath, full)
		}
	} else if *update {
		t.Fatal("-update needs Firecracker's whole definition: set FIRECRACKER_API_DEFINITION")
	}

	data, err := os.ReadFile(excerptPath)
	if err != nil {
		t.Fatal(err)
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
		t.Errorf("testdata/api.json differs from what %s defines; rerun with -update and review the diff", excerptPath)
	}
}
