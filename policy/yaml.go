package policy

import (
	"fmt"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

var reYAMLLine = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

// yamlParserProblems are the messages of the YAML parser (as opposed to its scanner). The yaml
// package reports their line 0-based, at the start of the enclosing collection; the scanner's are
// 1-based. The parser's are shifted here so that every line is 1-based.
var yamlParserProblems = map[string]bool{
	"did not find expected ',' or ']'": true, "did not find expected ',' or '}'": true,
	"did not find expected '-' indicator": true, "did not find expected <document start>": true,
	"did not find expected <stream-start>": true, "did not find expected key": true,
	"did not find expected node content": true, "found duplicate %TAG directive": true,
	"found duplicate %YAML directive": true, "found incompatible YAML document": true,
	"found undefined tag handle": true,
}

func (p *parser) yamlError(err error, data []byte) {
	lines := strings.Split(string(data), "\n")
	for _, msg := range strings.Split(err.Error(), "\n") {
		msg = strings.TrimSpace(msg)
		if msg == "" || msg == "yaml: unmarshal errors:" {
			continue
		}
		if m := reYAMLLine.FindStringSubmatch(msg); m != nil {
			line, _ := strconv.Atoi(m[1])
			if yamlParserProblems[m[2]] {
				line++
			}
			hint := ""
			if strings.Contains(m[2], "did not find expected ','") && line >= 1 && line <= len(lines) &&
				strings.Contains(lines[line-1], "[") && strings.Contains(lines[line-1], "/{") {
				hint = ` (inside [ ] or { }, quote templates with braces: ["/orders/{id}"])`
			}
			p.errf(line, "", "invalid YAML: %s%s", m[2], hint)
			continue
		}
		msg = strings.TrimPrefix(msg, "yaml: ")
		line := 0
		if yamlParserProblems[msg] {
			line = 1 // the parser omits line 1 (0-based 0)
		}
		p.errf(line, "", "invalid YAML: %s", msg)
	}
}

// noAliases rejects aliases (and with them merge keys): a policy should read as what it means,
// and expanding aliases is how small YAML files become huge.
func (p *parser) noAliases(n *yaml.Node) {
	if n.Kind == yaml.AliasNode {
		p.errf(n.Line, "", "YAML aliases are not supported in policy files: write the value out")
		return
	}
	for _, c := range n.Content {
		p.noAliases(c)
	}
}

// fieldSet is a mapping's fields by name.
type fieldSet struct {
	m    map[string]*yaml.Node
	keys map[string]int // line of each field's name
	line int
}

func (f fieldSet) get(name string) *yaml.Node { return f.m[name] }

// at is the line of a field's name: where errors about its whole value point.
func (f fieldSet) at(name string) int { return f.keys[name] }

func join(path, field string) string {
	if path == "" {
		return field
	}
	return path + "." + field
}

func index(path, key string) string {
	for i := 0; i < len(key); i++ {
		c := key[i]
		if !(c == '-' || c == '_' || c == '.' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9') {
			return path + "[" + strconv.Quote(key) + "]"
		}
	}
	return path + "[" + key + "]"
}

// fields checks that n is a mapping whose keys are known field names, each at most once.
func (p *parser) fields(n *yaml.Node, path string, known ...string) (fieldSet, bool) {
	f := fieldSet{m: map[string]*yaml.Node{}, keys: map[string]int{}, line: n.Line}
	if n.Kind != yaml.MappingNode {
		p.errf(n.Line, path, "must be a mapping with fields %s", strings.Join(known, ", "))
		return f, false
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		name := k.Value
		switch {
		case k.Kind != yaml.ScalarNode:
			p.errf(k.Line, path, "field names must be plain words")
		case k.Tag == "!!merge":
			p.errf(k.Line, join(path, name), "merge keys are not supported in policy files: write the fields out")
		case !slices.Contains(known, name):
			msg := "unknown field"
			if len(p.errs) >= maxErrors {
				p.dropped++
				continue
			}
			if s := suggest(name, known); s != "" {
				msg += fmt.Sprintf(" (did you mean %q?)", s)
			}
			p.errf(k.Line, join(path, name), "%s; known fields: %s", msg, strings.Join(known, ", "))
		case f.m[name] != nil:
			p.errf(k.Line, join(path, name), "duplicate field (first on line %d)", f.m[name].Line)
		default:
			f.m[name] = v
			f.keys[name] = k.Line
		}
	}
	return f, true
}

// suggest returns the known name closest to name, if it is a likely typo.
func suggest(name string, known []string) string {
	best, bestD := "", 3
	for _, k := range known {
		if d := editDistance(name, k); d < bestD {
			best, bestD = k, d
		}
	}
	return best
}

func editDistance(a, b string) int {
	if len(a) > 64 || len(b) > 64 {
		return math.MaxInt
	}
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			c := 1
			if a[i-1] == b[j-1] {
				c = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+c)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// entry is one key/value pair of a mapping with free keys (methods, regions, overrides, cost).
type entry struct {
	key     string
	line    int
	val     *yaml.Node
	keyNode *yaml.Node
}

func (p *parser) entries(n *yaml.Node, path string, what string) []entry {
	if n.Kind != yaml.MappingNode {
		p.errf(n.Line, path, "must be a mapping of %s", what)
		return nil
	}
	var out []entry
	seen := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.Kind != yaml.ScalarNode || k.Tag == "!!null" {
			p.errf(k.Line, path, "keys must be scalars")
			continue
		}
		if first, dup := seen[k.Value]; dup {
			p.errf(k.Line, index(path, k.Value), "duplicate key (first on line %d)", first)
			continue
		}
		seen[k.Value] = k.Line
		out = append(out, entry{key: k.Value, line: k.Line, val: v, keyNode: k})
	}
	return out
}

func (p *parser) seq(n *yaml.Node, path string) ([]*yaml.Node, bool) {
	if n.Kind != yaml.SequenceNode {
		p.errf(n.Line, path, "must be a list")
		return nil, false
	}
	return n.Content, true
}

// str reads a scalar as text. Numbers are accepted as written ("1.10" stays "1.10").
func (p *parser) str(n *yaml.Node, path string) (string, bool) {
	if n.Kind != yaml.ScalarNode {
		p.errf(n.Line, path, "must be a single value")
		return "", false
	}
	switch n.Tag {
	case "!!str", "!!int", "!!float":
	case "!!null":
		p.errf(n.Line, path, "must not be empty")
		return "", false
	default:
		p.errf(n.Line, path, "must be text, not %s", tagName(n.Tag))
		return "", false
	}
	if n.Value == "" {
		p.errf(n.Line, path, "must not be empty")
		return "", false
	}
	return n.Value, true
}

// oneOf reads a scalar that must be one of words and returns its index in words.
func (p *parser) oneOf(n *yaml.Node, path string, words ...string) (int, bool) {
	w, ok := p.str(n, path)
	if !ok {
		return 0, false
	}
	i := slices.Index(words, w)
	if i < 0 {
		p.errf(n.Line, path, "%q must be %s or %s", w, strings.Join(words[:len(words)-1], ", "), words[len(words)-1])
		return 0, false
	}
	return i, true
}

func (p *parser) integer(n *yaml.Node, path string) (int64, bool) {
	if n.Kind != yaml.ScalarNode || n.Tag != "!!int" {
		p.errf(n.Line, path, "must be a whole number, not %s", describeNode(n))
		return 0, false
	}
	v, err := strconv.ParseInt(strings.ReplaceAll(n.Value, "_", ""), 0, 64)
	if err != nil {
		p.errf(n.Line, path, "%q is out of range", n.Value)
		return 0, false
	}
	return v, true
}

func (p *parser) boolean(n *yaml.Node, path string) (bool, bool) {
	if n.Kind != yaml.ScalarNode || n.Tag != "!!bool" {
		p.errf(n.Line, path, "must be true or false, not %s", describeNode(n))
		return false, false
	}
	return strings.EqualFold(n.Value, "true"), true
}

func tagName(tag string) string {
	switch tag {
	case "!!str":
		return "text"
	case "!!int":
		return "a whole number"
	case "!!float":
		return "a decimal number"
	case "!!bool":
		return "true/false"
	case "!!null":
		return "empty"
	case "!!map":
		return "a mapping"
	case "!!seq":
		return "a list"
	default:
		return "a value tagged " + tag
	}
}

func describeNode(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	if n.Tag == "!!str" {
		return strconv.Quote(n.Value)
	}
	return tagName(n.Tag)
}

// list reads field of the rule at path: a list, required (what it holds, for the error when it is
// missing) and not empty (one names an item). ok is false when it is missing or not a list.
func (p *parser) list(f fieldSet, path, field, what, one string) (items []*yaml.Node, ok bool) {
	fp := join(path, field)
	v := f.get(field)
	if v == nil {
		p.errf(f.line, fp, "required: %s", what)
		return nil, false
	}
	if items, ok = p.seq(v, fp); ok && len(items) == 0 {
		p.errf(v.Line, fp, "must list at least one %s", one)
	}
	return items, ok
}
