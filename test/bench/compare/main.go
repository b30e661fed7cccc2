// Command compare runs the control-plane bench (test/bench/controlplane) of two commits
// alternately in one session on this machine, each commit's own operator and bench, one run at a
// time (base, head, base, head, ...), and prints each figure's median on both and head's ratio
// to base's: what a change costs, measured against its parent in the same run.
//
//	go run ./test/bench/compare -base d7f15fe -runs 3 -- -n 1000 -m 100   (make bench-compare BASE=d7f15fe)
//
// Each commit is checked out in a worktree of its own under -dir and built there (bin/imp-operator,
// bin/bench-controlplane); the flags after -- go to both benches. Each run's whole output is kept
// beside them (<dir>/<base|head>-<i>.log).
package main

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

func main() {
	base := flag.String("base", "", "the commit to compare with (required)")
	head := flag.String("head", "HEAD", "the commit compared")
	runs := flag.Int("runs", 3, "runs of each, alternated")
	dir := flag.String("dir", "", "where the worktrees and logs go (default: a new directory under the temporary one)")
	flag.Parse()
	if *base == "" {
		fmt.Fprintln(os.Stderr, "compare: -base is required")
		os.Exit(2)
	}
	if err := run(*base, *head, *runs, *dir, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "compare:", err)
		os.Exit(1)
	}
}

type side struct {
	name, rev, dir string
	runs           []map[string]float64
	units          map[string]string
	order          []string
}

func run(base, head string, runs int, dir string, benchArgs []string) error {
	// Worktrees in a directory of its own making are removed at the end (the logs stay);
	// in one given with -dir they are kept, for the next comparison to build on.
	keep := dir != ""
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp("", "bench-compare"); err != nil {
			return err
		}
	}
	sides := []*side{{name: "base", rev: base}, {name: "head", rev: head}}
	if !keep {
		defer func() {
			for _, s := range sides {
				if s.dir != "" {
					_ = sh("", "git", "worktree", "remove", "--force", s.dir)
				}
			}
			fmt.Printf("logs: %s\n", dir)
		}()
	}
	for _, s := range sides {
		s.dir = filepath.Join(dir, s.name)
		full, err := output("git", "rev-parse", "--verify", s.rev+"^{commit}")
		if err != nil {
			return fmt.Errorf("resolving %s: %w", s.rev, err)
		}
		s.rev = strings.TrimSpace(full)
		if _, err := os.Stat(s.dir); err != nil {
			if err := sh("", "git", "worktree", "add", "--detach", s.dir, s.rev); err != nil {
				return err
			}
		} else if err := sh(s.dir, "git", "checkout", "--detach", "-q", s.rev); err != nil {
			return err
		}
		fmt.Printf("%s: %s (%s)\n", s.name, s.rev[:12], s.dir)
		if err := sh(s.dir, "go", "build", "-o", "bin/", "./cmd/imp-operator"); err != nil {
			return err
		}
		if err := sh(s.dir, "go", "build", "-o", "bin/bench-controlplane", "./test/bench/controlplane"); err != nil {
			return err
		}
	}
	for i := 1; i <= runs; i++ {
		for _, s := range sides {
			log := filepath.Join(dir, fmt.Sprintf("%s-%d.log", s.name, i))
			fmt.Printf("run %d of %d: %s ... ", i, runs, s.name)
			cmd := exec.Command(filepath.Join(s.dir, "bin/bench-controlplane"), append([]string{"-runs", "1"}, benchArgs...)...)
			cmd.Dir = s.dir
			out, err := cmd.CombinedOutput()
			_ = os.WriteFile(log, out, 0o644)
			if err != nil {
				return fmt.Errorf("the bench of %s failed (%s): %w", s.name, log, err)
			}
			figures, units, order := parse(string(out))
			if len(figures) == 0 {
				return fmt.Errorf("no figures in %s", log)
			}
			s.runs, s.units = append(s.runs, figures), units
			if s.order == nil {
				s.order = order
			}
			fmt.Printf("operator CPU placing %s s, running %s s\n", num(figures["place: operator CPU"]), num(figures["run: operator CPU"]))
		}
	}
	report(sides[0], sides[1])
	return nil
}

// summary is a line of the bench's summary: "  <name> <median> (<min>–<max>) <unit>".
var summary = regexp.MustCompile(`^  (.+?)\s+(-?[0-9.]+) \((-?[0-9.]+)–(-?[0-9.]+)\) ?(.*)$`)

// parse reads the figures of a one-run bench's summary (its median is its value).
func parse(out string) (map[string]float64, map[string]string, []string) {
	figures, units := map[string]float64{}, map[string]string{}
	var order []string
	in := false
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "over ") && strings.Contains(line, "median") {
			in = true
			continue
		}
		m := summary.FindStringSubmatch(line)
		if !in || m == nil {
			continue
		}
		v, err := strconv.ParseFloat(m[2], 64)
		if err != nil {
			continue
		}
		figures[m[1]], units[m[1]] = v, m[5]
		order = append(order, m[1])
	}
	return figures, units, order
}

func median(runs []map[string]float64, name string) (float64, bool) {
	var vs []float64
	for _, r := range runs {
		if v, ok := r[name]; ok {
			vs = append(vs, v)
		}
	}
	if len(vs) == 0 {
		return 0, false
	}
	sort.Float64s(vs)
	return vs[len(vs)/2], true
}

func report(base, head *side) {
	fmt.Printf("\n%d runs each, alternated; median of each figure\n", len(head.runs))
	fmt.Printf("  %-44s %12s %12s %8s\n", "figure", "base", "head", "head/base")
	for _, name := range head.order {
		h, _ := median(head.runs, name)
		b, ok := median(base.runs, name)
		ratio := "-"
		if ok && b != 0 {
			ratio = fmt.Sprintf("%.2f×", h/b)
		}
		bs := "-"
		if ok {
			bs = num(b)
		}
		fmt.Printf("  %-44s %12s %12s %8s %s\n", name, bs, num(h), ratio, head.units[name])
	}
}

func num(v float64) string {
	if v >= 100 || v == float64(int64(v)) {
		return strconv.FormatFloat(v, 'f', 0, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

func output(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).Output()
	return string(out), err
}

func sh(dir, name string, args ...string) error {
	cmd := exec.Command(name, args...)
	cmd.Dir, cmd.Stdout, cmd.Stderr = dir, os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %s: %w", name, strings.Join(args, " "), err)
	}
	return nil
}
