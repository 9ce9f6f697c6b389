package redistest

import "syscall"

// procAttr puts the child in its own process group (so a signal to the test's group, such as a
// terminal's Ctrl-C, does not reach it first, and Kill can signal the whole group) and asks the
// kernel to SIGKILL it when its parent dies: no redis-server outlives a crashed test binary.
// Strictly, the kernel sends the signal when the OS thread that started the child exits; the Go
// runtime keeps its threads for the life of the process unless a goroutine exits while locked to
// one with runtime.LockOSThread.
func procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
