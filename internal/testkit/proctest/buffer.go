package proctest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"strings"
	"sync"
)

// Buffer is a bytes.Buffer that goroutines may write and read at the same time: a log sink for a
// process or for a command run in the test's process.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p to the buffer.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

// String is what was written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// Records are the lines written so far that are JSON objects (log records), in order; other
// lines are skipped.
func (b *Buffer) Records() []map[string]any {
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(b.String()))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		var rec map[string]any
		if json.Unmarshal(sc.Bytes(), &rec) == nil {
			out = append(out, rec)
		}
	}
	return out
}
