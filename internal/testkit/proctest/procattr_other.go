//go:build !linux

package proctest

import "syscall"

// procAttr is nil: only Linux can tie the child's life to the test binary's (Pdeathsig);
// elsewhere a crashed test may leave a process behind.
func procAttr() *syscall.SysProcAttr { return nil }
