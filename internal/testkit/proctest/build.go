package proctest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
)

// Binaries are commands of the module built for the tests of one test binary: once, on first
// use, into a temporary directory that Remove deletes.
type Binaries struct {
	pkgs map[string]string // binary name to package path

	once sync.Once
	dir  string
	err  error
}

// NewBinaries returns the binaries of pkgs, a map from binary name to package path as go build
// takes it (relative to the test's package directory). Nothing is built yet.
func NewBinaries(pkgs map[string]string) *Binaries {
	return &Binaries{pkgs: pkgs}
}

// Path returns the path of the binary name, building every binary first if none is built yet.
// The test fails if the build failed or name is not one of the binaries.
func (b *Binaries) Path(t testing.TB, name string) string {
	t.Helper()
	b.once.Do(func() { b.dir, b.err = build(b.pkgs) })
	if b.err != nil {
		t.Fatalf("build: %v", b.err)
	}
	if _, ok := b.pkgs[name]; !ok {
		t.Fatalf("build: no binary %q", name)
	}
	return filepath.Join(b.dir, name)
}

// Remove deletes the built binaries. TestMain calls it once the tests have run.
func (b *Binaries) Remove() {
	b.once.Do(func() {}) // nothing is built after this
	if b.dir != "" {
		_ = os.RemoveAll(b.dir)
	}
}

// build compiles every package of pkgs, concurrently and without cgo, into a new temporary
// directory and returns it; on error it removes the directory.
func build(pkgs map[string]string) (string, error) {
	dir, err := os.MkdirTemp("", "proctest-bin")
	if err != nil {
		return "", err
	}
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for name, pkg := range pkgs {
		wg.Go(func() {
			cmd := exec.Command("go", "build", "-o", filepath.Join(dir, name), pkg)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				mu.Lock()
				errs = append(errs, fmt.Errorf("go build %s: %w\n%s", pkg, err, out))
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		_ = os.RemoveAll(dir)
		return "", err
	}
	return dir, nil
}
