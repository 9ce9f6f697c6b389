package httplimit_test

import (
	"os"
	"strings"
	"testing"
)

// TestDocsExample: the Go code docs/gateway.md shows is the body of Example, which compiles
// with these tests.
func TestDocsExample(t *testing.T) {
	doc, err := os.ReadFile("../docs/gateway.md")
	if err != nil {
		t.Fatal(err)
	}
	_, after, ok := strings.Cut(string(doc), "<!-- example: httplimit/example_test.go -->\n```go\n")
	if !ok {
		t.Fatal("docs/gateway.md: no example block")
	}
	shown, _, _ := strings.Cut(after, "```")
	src, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	_, body, ok := strings.Cut(string(src), "func Example() {\n")
	if !ok {
		t.Fatal("example_test.go: no func Example")
	}
	body, _, _ = strings.Cut(body, "\n}\n")
	if strings.TrimSpace(shown) != strings.TrimSpace(body) {
		t.Errorf("docs/gateway.md shows another example than example_test.go's Example:\n--- docs\n%s\n--- Example\n%s", shown, body)
	}
}
