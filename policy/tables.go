package policy

import (
	"regexp"
	"slices"

	"go.yaml.in/yaml/v3"
)

// operationsTable reads methods and operations and interns every operation name.
func (p *parser) operationsTable(s *Set, f fieldSet) {
	s.methods = map[string]string{}
	for m, c := range defaultMethods {
		s.methods[m] = c
	}
	p.classTable(f, "methods", "HTTP methods to classes", "HTTP method", reMethod, s.methods, nil)
	s.named = map[string]string{}
	namedLine := map[string]int{}
	p.classTable(f, "operations", "named operations to classes", "named operation", reNamedOp, s.named, namedLine)
	classSet := map[string]bool{"read": true, "write": true}
	for _, c := range s.methods {
		classSet[c] = true
	}
	for _, c := range s.named {
		classSet[c] = true
	}
	for name := range s.named {
		if classSet[name] {
			p.errf(namedLine[name], index("operations", name),
				"%q is used as a class (by a method or another operation); a named operation needs its own name", name)
		}
	}
	for c := range classSet {
		s.classes = append(s.classes, c)
	}
	slices.Sort(s.classes)

	ids := map[string]int32{}
	intern := func(name string) int32 {
		if id, ok := ids[name]; ok {
			return id
		}
		id := int32(len(s.opNames))
		s.opNames = append(s.opNames, name)
		ids[name] = id
		return id
	}
	s.ops = map[string]opRef{}
	for _, c := range s.classes {
		id := intern(c)
		s.ops[c] = opRef{exact: id, class: id, kind: opClass}
	}
	for _, name := range sortedKeys(s.named) {
		if classSet[name] {
			continue
		}
		s.ops[name] = opRef{exact: intern(name), class: ids[s.named[name]], kind: opNamed}
	}
	for _, m := range sortedKeys(s.methods) {
		s.ops[m] = opRef{exact: intern(m), class: ids[s.methods[m]], kind: opMethod}
	}
	if len(s.ops) <= maxLinearOps {
		// Most frequent first: methods, then classes, then named operations.
		for _, kind := range []opKind{opMethod, opClass, opNamed} {
			for _, name := range sortedKeys(s.ops) {
				if s.ops[name].kind == kind {
					s.opList = append(s.opList, opEntry{name, s.ops[name]})
				}
			}
		}
	}
}

// classTable reads field, a mapping of names (noun, matching re) to class names, into m; lines,
// if not nil, gets the line of each entry read.
func (p *parser) classTable(f fieldSet, field, what, noun string, re *regexp.Regexp, m map[string]string, lines map[string]int) {
	n := f.get(field)
	if n == nil {
		return
	}
	for _, e := range p.entries(n, field, what) {
		path := index(field, e.key)
		if !re.MatchString(e.key) {
			p.errf(e.line, path, "%s %q must match %s", noun, e.key, re)
			continue
		}
		c, ok := p.str(e.val, path)
		if !ok {
			continue
		}
		if !reClass.MatchString(c) {
			p.errf(e.val.Line, path, "class %q must match %s", c, reClass)
			continue
		}
		m[e.key] = c
		if lines != nil {
			lines[e.key] = e.line
		}
	}
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func (p *parser) envoy(n *yaml.Node) Envoy {
	e := Envoy{Domain: "leasebucket", TenantKey: "tenant", RouteKey: "path", OperationKey: "method", SettleKey: "settle"}
	if n == nil {
		return e
	}
	f, ok := p.fields(n, "envoy", "domain", "tenant_key", "route_key", "operation_key", "settle_key", "charge")
	if !ok {
		return e
	}
	read := func(name string, re *regexp.Regexp, dst *string) {
		if v := f.get(name); v != nil {
			path := join("envoy", name)
			if s, ok := p.str(v, path); ok {
				if !re.MatchString(s) {
					p.errf(v.Line, path, "%q must match %s", s, re)
					return
				}
				*dst = s
			}
		}
	}
	read("domain", reDomain, &e.Domain)
	read("tenant_key", reDescriptr, &e.TenantKey)
	read("route_key", reDescriptr, &e.RouteKey)
	read("operation_key", reDescriptr, &e.OperationKey)
	read("settle_key", reDescriptr, &e.SettleKey)
	if v := f.get("charge"); v != nil {
		if i, ok := p.oneOf(v, "envoy.charge", "all_or_nothing", "per_descriptor"); ok {
			e.PerDescriptor = i == 1
		}
	}
	if e.TenantKey == e.RouteKey || e.TenantKey == e.OperationKey || e.RouteKey == e.OperationKey ||
		e.SettleKey == e.TenantKey || e.SettleKey == e.RouteKey || e.SettleKey == e.OperationKey {
		p.errf(n.Line, "envoy", "tenant_key, route_key, operation_key and settle_key must be different descriptor keys (got %q, %q, %q, %q)",
			e.TenantKey, e.RouteKey, e.OperationKey, e.SettleKey)
	}
	return e
}
