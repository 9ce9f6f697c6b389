//go:build unix && !linux

package redistest

import "syscall"

// procAttr puts the child in its own process group. Only Linux can also tie the child's life to
// the test binary's (Pdeathsig); elsewhere a crashed test may leave a redis-server behind.
func procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
