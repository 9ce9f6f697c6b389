package cli

import (
	"flag"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
)

// usageWidth is where help text wraps: terminals are at least 80 columns wide, and long lines of
// prose are hard to read.
const usageWidth = 100

// PrintUsage writes the usage to the flag set's output: the header, then each flag in
// alphabetical order as
//
//	--name VALUE  (ENVIRONMENT_VARIABLE, default D)
//	    what it does, wrapped
//
// (VALUE is the first `quoted` word of the flag's usage, or its type), then the deprecated names
// still accepted. This is the --help of every command.
func (f *Flags) PrintUsage() {
	w := f.Output()
	fmt.Fprint(w, f.header)
	f.VisitAll(func(fl *flag.Flag) {
		if _, old := f.renamedFlag[fl.Name]; old {
			return
		}
		value, usage := flag.UnquoteUsage(fl)
		line := "  --" + fl.Name
		if value != "" {
			line += " " + value
		}
		var notes []string
		if env := f.env[fl.Name]; env != "" {
			notes = append(notes, env)
		}
		if !zeroDefault(fl.DefValue) {
			notes = append(notes, "default "+fl.DefValue)
		}
		if len(notes) > 0 {
			line += "  (" + strings.Join(notes, ", ") + ")"
		}
		fmt.Fprintln(w, line)
		wrap(w, "      ", usage)
	})
	if len(f.renamedFlag) == 0 && len(f.renamedEnv) == 0 {
		return
	}
	fmt.Fprintln(w, "\nDeprecated names, still accepted until the next release:")
	for _, old := range slices.Sorted(maps.Keys(f.renamedFlag)) {
		fmt.Fprintf(w, "  --%-30s use --%s\n", old, f.renamedFlag[old])
	}
	for _, nw := range slices.Sorted(maps.Keys(f.renamedEnv)) {
		fmt.Fprintf(w, "  %-32s use %s\n", f.renamedEnv[nw], nw)
	}
}

// zeroDefault reports whether a default says nothing worth printing: empty, false or zero.
func zeroDefault(def string) bool {
	switch def {
	case "", "false", "0", "0s":
		return true
	}
	return false
}

// wrap writes text in lines of at most usageWidth columns, each starting with indent; a word
// longer than a line gets a line of its own.
func wrap(w io.Writer, indent, text string) {
	line := indent
	for _, word := range strings.Fields(text) {
		if line != indent && len(line)+1+len(word) > usageWidth {
			fmt.Fprintln(w, line)
			line = indent
		}
		if line != indent {
			line += " "
		}
		line += word
	}
	if line != indent {
		fmt.Fprintln(w, line)
	}
}
