package policy

import (
	"fmt"
	"strings"
)

// FieldError is one problem of a policy file: where it is (file, line, field path such as
// "rules[1].emergency.limit") and what is wrong. Line 0 means the position is unknown.
type FieldError struct {
	File  string
	Line  int
	Field string
	Msg   string
}

func (e *FieldError) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Line > 0 {
		fmt.Fprintf(&b, ":%d", e.Line)
	}
	b.WriteString(": ")
	if e.Field != "" {
		b.WriteString(e.Field)
		b.WriteString(": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// ParseError holds every problem found in one policy file, in line order. Its message is one
// "file:line: field: message" line per problem.
type ParseError struct {
	File   string
	Errors []*FieldError
}

func (e *ParseError) Error() string {
	lines := make([]string, len(e.Errors))
	for i, fe := range e.Errors {
		lines[i] = fe.Error()
	}
	return strings.Join(lines, "\n")
}

// Unwrap exposes the individual problems to errors.Is and errors.As.
func (e *ParseError) Unwrap() []error {
	out := make([]error, len(e.Errors))
	for i, fe := range e.Errors {
		out[i] = fe
	}
	return out
}
