package policy

import (
	"os"
	"strings"
	"testing"
)

// TestDocsExample keeps docs/policy.md true: its complete example is the shipped example file.
func TestDocsExample(t *testing.T) {
	doc, err := os.ReadFile("../docs/policy.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(doc), "## A complete example")
	if !ok {
		t.Fatal("docs/policy.md has no complete example")
	}
	_, rest, _ = strings.Cut(rest, "```yaml\n")
	src, _, ok := strings.Cut(rest, "```\n")
	if !ok {
		t.Fatal("the example's code block is not closed")
	}
	s, err := Parse("docs/policy.md", []byte(src))
	if err != nil {
		t.Fatalf("the documented example does not parse:\n%v", err)
	}
	if want := loadExample(t).Digest(); s.Digest() != want {
		t.Errorf("the documented example (digest %s) differs from examples/policy.yaml (digest %s)", s.Digest(), want)
	}
}
