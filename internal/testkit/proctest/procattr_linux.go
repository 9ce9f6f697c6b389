package proctest

import "syscall"

// procAttr asks the kernel to SIGKILL the child when the test binary dies, so that no process
// outlives a crashed test. Strictly, the signal comes when the OS thread that started the child
// exits; the Go runtime keeps its threads for the life of the process unless a goroutine exits
// while locked to one with runtime.LockOSThread.
func procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
