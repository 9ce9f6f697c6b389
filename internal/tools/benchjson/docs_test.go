package main

import (
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"testing"
)

// outputs are the benchmark files the docs name as what a make target writes, not as a kept run.
var outputs = map[string]bool{"bench/stack.txt": true}

// TestDocsCiteKeptRuns: every benchmark run README.md and docs/*.md cite as a file under bench/
// is in the checkout. CI's checkout holds only what git tracks, so a cited run that was never
// added fails here rather than leaving a dead reference.
func TestDocsCiteKeptRuns(t *testing.T) {
	docs, err := filepath.Glob("../../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	docs = append(docs, "../../../README.md")
	cite := regexp.MustCompile(`bench/[A-Za-z0-9._-]+\.(?:txt|json)`)
	missing := map[string][]string{}
	n := 0
	for _, doc := range docs {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range cite.FindAllString(string(b), -1) {
			n++
			if outputs[f] {
				continue
			}
			if _, err := os.Stat(filepath.Join("../../..", f)); err != nil {
				missing[f] = append(missing[f], filepath.Base(doc))
			}
		}
	}
	if n == 0 {
		t.Fatal("no bench/ file cited in README.md or docs/: the pattern no longer matches how they cite runs")
	}
	var names []string
	for f := range missing {
		names = append(names, f)
	}
	sort.Strings(names)
	for _, f := range names {
		t.Errorf("%s is cited (%v) but not in the checkout: commit it or cite what is", f, missing[f])
	}
}
