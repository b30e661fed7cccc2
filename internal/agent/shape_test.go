package agent

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// TestTheAgentOnlyReconciles holds the root package to its shape (issue 46): Agent reconciles
// and chooses plans, and what has state of its own lives in packages of its own. Agent has at
// most 30 methods, the package at most 2,500 lines, no file more than 450, and no two of its
// files call each other both ways.
func TestTheAgentOnlyReconciles(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	parsed := map[string]*ast.File{}
	lines := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		n := strings.Count(string(src), "\n")
		if lines += n; n > 450 {
			t.Errorf("%s has %d lines; at most 450", f, n)
		}
		if parsed[f], err = parser.ParseFile(fset, f, src, 0); err != nil {
			t.Fatal(err)
		}
	}
	if lines > 2500 {
		t.Errorf("the package has %d lines; at most 2,500", lines)
	}
	// Where each function and each method of Agent is declared.
	funcs, methods := map[string]string{}, map[string]string{}
	for name, f := range parsed {
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			switch {
			case !ok:
			case fd.Recv == nil:
				funcs[fd.Name.Name] = name
			case receiver(fd) == "Agent":
				methods[fd.Name.Name] = name
			}
		}
	}
	if len(methods) > 30 {
		t.Errorf("Agent has %d methods; at most 30", len(methods))
	}
	// Who calls whom, file to file: a function of the package by name, a method of Agent on
	// a or on some x.a.
	calls := map[[2]string]string{}
	for name, f := range parsed {
		ast.Inspect(f, func(n ast.Node) bool {
			c, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			var to, what string
			switch fn := c.Fun.(type) {
			case *ast.Ident:
				to, what = funcs[fn.Name], fn.Name
			case *ast.SelectorExpr:
				if isAgent(fn.X) {
					to, what = methods[fn.Sel.Name], "a."+fn.Sel.Name
				}
			}
			if to != "" && to != name {
				calls[[2]string{name, to}] = what
			}
			return true
		})
	}
	var both []string
	for edge, what := range calls {
		if back, ok := calls[[2]string{edge[1], edge[0]}]; ok && edge[0] < edge[1] {
			both = append(both, edge[0]+" calls "+edge[1]+" ("+what+") and back ("+back+")")
		}
	}
	sort.Strings(both)
	for _, b := range both {
		t.Error(b)
	}
}

func receiver(fd *ast.FuncDecl) string {
	typ := fd.Recv.List[0].Type
	if s, ok := typ.(*ast.StarExpr); ok {
		typ = s.X
	}
	if id, ok := typ.(*ast.Ident); ok {
		return id.Name
	}
	return ""
}

// isAgent: x is the agent (a), or a field a of something (s.a).
func isAgent(x ast.Expr) bool {
	switch x := x.(type) {
	case *ast.Ident:
		return x.Name == "a"
	case *ast.SelectorExpr:
		return x.Sel.Name == "a"
	}
	return false
}
