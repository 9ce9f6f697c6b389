package redistest

import (
	"fmt"
	"strconv"
	"strings"
)

// CommandStat is one command's line of INFO commandstats: its calls so far and the microseconds
// they took.
type CommandStat struct {
	Calls, Usec float64
}

// ScriptCommands are the commands that run a script or a function.
var ScriptCommands = map[string]bool{
	"eval": true, "evalsha": true, "eval_ro": true, "evalsha_ro": true, "fcall": true, "fcall_ro": true,
}

// ParseCommandStats reads a reply of INFO commandstats ("cmdstat_evalsha:calls=12,usec=…,…"):
// each command's calls and microseconds, by its name as the reply spells it.
func ParseCommandStats(info string) (map[string]CommandStat, error) {
	out := map[string]CommandStat{}
	for line := range strings.SplitSeq(info, "\n") {
		name, stats, ok := strings.Cut(strings.TrimSpace(line), ":")
		cmd, isStat := strings.CutPrefix(name, "cmdstat_")
		if !ok || !isStat {
			continue
		}
		var c CommandStat
		for kv := range strings.SplitSeq(stats, ",") {
			field, v, _ := strings.Cut(kv, "=")
			var to *float64
			switch field {
			case "calls":
				to = &c.Calls
			case "usec":
				to = &c.Usec
			default:
				continue
			}
			n, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return nil, fmt.Errorf("redistest: commandstats %q: %w", line, err)
			}
			*to = n
		}
		out[cmd] = c
	}
	return out, nil
}
