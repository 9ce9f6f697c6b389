package proctest

// Pid is the process id, for reading the process's own figures (/proc/<pid>/stat).
func (p *Process) Pid() int { return p.cmd.Process.Pid }
