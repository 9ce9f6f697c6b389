package policy

import (
	"errors"
	"fmt"
	"sort"
	"strings"
)

const (
	// MaxTemplateLen bounds a route template as written; with MaxTemplateSegments it keeps every
	// bucket key within MaxKeyLen (validation checks the exact bound per key).
	MaxTemplateLen = 256

	// MaxTemplateSegments bounds the segments of a template; the matcher's work per request is
	// bounded by the number of trie nodes, which this and the number of templates bound.
	MaxTemplateSegments = 32

	// maxParamName bounds a parameter name in a template.
	maxParamName = 32

	// linearLiterals is the number of literal children a trie node searches linearly before it
	// switches to a map: comparing a few short strings is cheaper than hashing one.
	linearLiterals = 8
)

type segKind uint8

const (
	segLiteral segKind = iota // matches exactly its text
	segParam                  // {name}: any one segment
	segWild                   // *: one or more remaining segments; last only
)

type tmplSeg struct {
	kind segKind
	text string // literal text, or the parameter name
}

// template is a parsed route template. shape is the template with parameter names erased
// ("/orders/{}"): two templates with one shape match exactly the same paths.
type template struct {
	raw   string
	segs  []tmplSeg
	shape string
}

// parseTemplate parses a route template such as "/orders/{id}" or "/users/{uid}/orders/*".
func parseTemplate(s string) (template, error) {
	t := template{raw: s}
	switch {
	case s == "":
		return t, errors.New("empty template")
	case s[0] != '/':
		return t, fmt.Errorf("template %q must start with '/'", s)
	case len(s) > MaxTemplateLen:
		return t, fmt.Errorf("template is longer than %d bytes", MaxTemplateLen)
	case s == "/":
		t.shape = "/"
		return t, nil
	case strings.HasSuffix(s, "/"):
		return t, fmt.Errorf("template %q must not end with '/' (trailing slashes are dropped from paths)", s)
	}
	names := map[string]bool{}
	parts := strings.Split(s[1:], "/")
	if len(parts) > MaxTemplateSegments {
		return t, fmt.Errorf("template %q has %d segments, more than %d", s, len(parts), MaxTemplateSegments)
	}
	var shape strings.Builder
	for i, p := range parts {
		shape.WriteByte('/')
		switch {
		case p == "":
			return t, fmt.Errorf("template %q has an empty segment", s)
		case p == "*":
			if i != len(parts)-1 {
				return t, fmt.Errorf("template %q: '*' is allowed only as the last segment", s)
			}
			t.segs = append(t.segs, tmplSeg{kind: segWild})
			shape.WriteByte('*')
		case p[0] == '{' && p[len(p)-1] == '}':
			name := p[1 : len(p)-1]
			if !validParamName(name) {
				return t, fmt.Errorf("template %q: parameter name %q must match [A-Za-z_][A-Za-z0-9_]* (at most %d bytes)",
					s, name, maxParamName)
			}
			if names[name] {
				return t, fmt.Errorf("template %q: parameter {%s} appears twice", s, name)
			}
			names[name] = true
			t.segs = append(t.segs, tmplSeg{kind: segParam, text: name})
			shape.WriteString("{}")
		case strings.ContainsAny(p, "{}"):
			return t, fmt.Errorf("template %q: segment %q: a parameter must be a whole segment such as {id}", s, p)
		case p == "." || p == "..":
			return t, fmt.Errorf("template %q: dot segments are resolved in paths and cannot match", s)
		default:
			canon, err := canonicalSegment(nil, p)
			if err != nil {
				return t, fmt.Errorf("template %q: segment %q: %v", s, p, errors.Unwrap(err)) //nolint:errorlint // the cause's text without its prefix
			}
			if string(canon) != p || string(canon) == "." || string(canon) == ".." {
				return t, fmt.Errorf("template %q: segment %q is not in normalized form (write %q): a normalized path never contains it",
					s, p, string(canon))
			}
			t.segs = append(t.segs, tmplSeg{kind: segLiteral, text: p})
			shape.WriteString(p)
		}
	}
	t.shape = shape.String()
	return t, nil
}

func validParamName(s string) bool {
	if s == "" || len(s) > maxParamName {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c == '_' || 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || i > 0 && '0' <= c && c <= '9') {
			return false
		}
	}
	return true
}

// node is a trie node of the matcher. Children are tried in precedence order: the literal child
// for the segment, then the parameter child, then the wildcard. A depth-first search in that order
// meets candidates in precedence order, so the first route found wins; each node is visited at most
// once per request, so the work is bounded by the size of the trie.
type node struct {
	lits   []litEdge // sorted by text
	litMap map[string]*node
	param  *node
	wild   *node
	ends   []endEntry // routes whose template ends here, by operation
}

type litEdge struct {
	text string
	next *node
}

// endEntry is a route ending at a node for one operation entry (class, named operation or method).
type endEntry struct {
	op    int32
	route int32
}

// insert adds the template's path to the trie and returns its final node.
func (n *node) insert(t template) *node {
	for _, s := range t.segs {
		switch s.kind {
		case segLiteral:
			i := sort.Search(len(n.lits), func(i int) bool { return n.lits[i].text >= s.text })
			if i < len(n.lits) && n.lits[i].text == s.text {
				n = n.lits[i].next
				continue
			}
			c := &node{}
			n.lits = append(n.lits, litEdge{})
			copy(n.lits[i+1:], n.lits[i:])
			n.lits[i] = litEdge{s.text, c}
			n = c
		case segParam:
			if n.param == nil {
				n.param = &node{}
			}
			n = n.param
		case segWild:
			if n.wild == nil {
				n.wild = &node{}
			}
			n = n.wild
		}
	}
	return n
}

// freeze switches nodes with many literal children to a map.
func (n *node) freeze() {
	if len(n.lits) > linearLiterals {
		n.litMap = make(map[string]*node, len(n.lits))
		for _, e := range n.lits {
			n.litMap[e.text] = e.next
		}
	}
	for _, e := range n.lits {
		e.next.freeze()
	}
	if n.param != nil {
		n.param.freeze()
	}
	if n.wild != nil {
		n.wild.freeze()
	}
}

func (n *node) literal(seg string) *node {
	if n.litMap != nil {
		return n.litMap[seg]
	}
	for i := range n.lits {
		if n.lits[i].text == seg {
			return n.lits[i].next
		}
	}
	return nil
}

// end returns the route ending here for the operation: the exact entry first, then the class.
func (n *node) end(exact, class int32) int32 {
	r := int32(-1)
	for _, e := range n.ends {
		if e.op == exact {
			return e.route
		}
		if e.op == class {
			r = e.route
		}
	}
	return r
}

// find matches the canonical path p from byte i (the start of a segment, or len(p) at the end)
// and returns the winning route, or -1.
func (n *node) find(p string, i int, exact, class int32) int32 {
	if i >= len(p) {
		return n.end(exact, class)
	}
	j := i
	for j < len(p) && p[j] != '/' {
		j++
	}
	if c := n.literal(p[i:j]); c != nil {
		if r := c.find(p, j+1, exact, class); r >= 0 {
			return r
		}
	}
	if n.param != nil {
		if r := n.param.find(p, j+1, exact, class); r >= 0 {
			return r
		}
	}
	if n.wild != nil {
		return n.wild.end(exact, class)
	}
	return -1
}

// collect appends every route matching p from byte i, in precedence order (for Explain).
func (n *node) collect(p string, i int, exact, class int32, out []int32) []int32 {
	if i >= len(p) {
		return n.appendEnds(exact, class, out)
	}
	j := i
	for j < len(p) && p[j] != '/' {
		j++
	}
	if c := n.literal(p[i:j]); c != nil {
		out = c.collect(p, j+1, exact, class, out)
	}
	if n.param != nil {
		out = n.param.collect(p, j+1, exact, class, out)
	}
	if n.wild != nil {
		out = n.wild.appendEnds(exact, class, out)
	}
	return out
}

func (n *node) appendEnds(exact, class int32, out []int32) []int32 {
	for _, e := range n.ends {
		if e.op == exact {
			out = append(out, e.route)
		}
	}
	if class != exact {
		for _, e := range n.ends {
			if e.op == class {
				out = append(out, e.route)
			}
		}
	}
	return out
}

// params returns the parameter bindings and the wildcard remainder of p under t, for Explain.
// p must match t.
func (t template) params(p string) []string {
	var out []string
	segs := strings.Split(strings.TrimPrefix(p, "/"), "/")
	for i, s := range t.segs {
		switch s.kind {
		case segParam:
			out = append(out, fmt.Sprintf("{%s}=%s", s.text, segs[i]))
		case segWild:
			out = append(out, "*="+strings.Join(segs[i:], "/"))
		}
	}
	return out
}

// precedence explains why template a wins over template b for the same path: the first segment
// where their kinds differ. Templates of one shape tie (they never reach here for one operation).
func precedence(a, b template) string {
	for i := 0; i < len(a.segs) && i < len(b.segs); i++ {
		if a.segs[i].kind != b.segs[i].kind {
			return fmt.Sprintf("segment %d: %s beats %s", i+1, describeSeg(a.segs[i]), describeSeg(b.segs[i]))
		}
	}
	return "same template"
}

func describeSeg(s tmplSeg) string {
	switch s.kind {
	case segLiteral:
		return fmt.Sprintf("literal %q", s.text)
	case segParam:
		return "{" + s.text + "}"
	default:
		return "*"
	}
}
