package agent

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

// DefaultSocket is where the agent listens unless told otherwise: the node's gateways dial it.
const DefaultSocket = "/run/leasebucket/agent.sock"

// SocketMode is the file mode of the socket: the agent's user and group may connect (connecting
// to a Unix socket needs write permission), nobody else.
const SocketMode os.FileMode = 0o660

// staleDial bounds the probe of an existing socket: a live agent on the same node accepts a
// connection in microseconds; a socket file nobody listens on refuses at once.
const staleDial = 200 * time.Millisecond

// ErrSocketInUse means another process serves the socket path: the agent refuses to start rather
// than take a live socket away from it.
var ErrSocketInUse = errors.New("agent: socket in use by another process")

// UnixListener is the agent's Unix socket. It holds an exclusive lock next to the socket for its
// lifetime, so two agents never serve (or remove) the same path, and on Close it removes the
// socket file only if it is still the one it created.
type UnixListener struct {
	*net.UnixListener
	path string
	lock *os.File
	info os.FileInfo // the socket file as created, to recognise it on Close

	closeOnce sync.Once
	closeErr  error
}

// ListenUnix listens on path with mode (SocketMode if 0) and, if gid >= 0, that group.
//
// An existing file at path is handled safely: a socket nobody answers (left by an agent that
// crashed) is removed; a socket that accepts a connection belongs to a live process and
// ListenUnix fails with ErrSocketInUse; anything that is not a socket is never removed. The
// socket is created under a temporary name, given its mode and group, and renamed into place, so
// the path clients dial never has the wrong permissions. The parent directory is created (0755) if
// missing.
func ListenUnix(path string, mode os.FileMode, gid int) (*UnixListener, error) {
	if mode == 0 {
		mode = SocketMode
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("agent: socket directory: %w", err)
	}
	lock, err := lockFile(path + ".lock")
	if err != nil {
		return nil, err
	}
	ln, info, err := listenLocked(path, mode, gid)
	if err != nil {
		_ = lock.Close()
		return nil, err
	}
	return &UnixListener{UnixListener: ln, path: path, lock: lock, info: info}, nil
}

// lockFile takes an exclusive, non-blocking flock on name; the kernel releases it when the process
// dies, so a crashed agent never leaves it held.
func lockFile(name string) (*os.File, error) {
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("agent: socket lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s is locked by another agent", ErrSocketInUse, name)
		}
		return nil, fmt.Errorf("agent: socket lock %s: %w", name, err)
	}
	return f, nil
}

func listenLocked(path string, mode os.FileMode, gid int) (*net.UnixListener, os.FileInfo, error) {
	if err := removeStale(path); err != nil {
		return nil, nil, err
	}
	tmp := path + ".tmp-" + strconv.Itoa(os.Getpid())
	_ = os.Remove(tmp) // ours from an earlier run with the same pid, under our lock
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, nil, fmt.Errorf("agent: listen on %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(false) // the file moves; Close removes it by its final name
	fail := func(err error) (*net.UnixListener, os.FileInfo, error) {
		_ = ln.Close()
		_ = os.Remove(tmp)
		return nil, nil, err
	}
	if err := os.Chmod(tmp, mode); err != nil {
		return fail(fmt.Errorf("agent: socket mode: %w", err))
	}
	if gid >= 0 {
		if err := os.Chown(tmp, -1, gid); err != nil {
			return fail(fmt.Errorf("agent: socket group: %w", err))
		}
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail(fmt.Errorf("agent: socket: %w", err))
	}
	info, err := os.Lstat(path)
	if err != nil {
		return fail(fmt.Errorf("agent: socket: %w", err))
	}
	return ln, info, nil
}

// removeStale removes path if it is a socket nobody answers on.
func removeStale(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("agent: socket: %w", err)
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("agent: %s exists and is not a socket; not removing it", path)
	}
	c, err := net.DialTimeout("unix", path, staleDial)
	if err == nil {
		_ = c.Close()
		return fmt.Errorf("%w: %s answers", ErrSocketInUse, path)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, syscall.ENOENT) {
		// A timeout or a permission error: something may be alive there; do not take it.
		return fmt.Errorf("%w: %s: %w", ErrSocketInUse, path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("agent: remove stale socket: %w", err)
	}
	return nil
}

// Addr is the socket's address: its path (the socket was bound under a temporary name).
func (l *UnixListener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

// Path is the socket's path.
func (l *UnixListener) Path() string { return l.path }

// Close stops listening, removes the socket file if it is still the one this listener created,
// and releases the lock. It may be called more than once (grpc.Server.Stop closes it too).
func (l *UnixListener) Close() error {
	l.closeOnce.Do(func() { l.closeErr = l.close() })
	return l.closeErr
}

func (l *UnixListener) close() error {
	err := l.UnixListener.Close()
	if fi, serr := os.Lstat(l.path); serr == nil && os.SameFile(fi, l.info) {
		if rerr := os.Remove(l.path); rerr != nil && err == nil {
			err = rerr
		}
	}
	_ = l.lock.Close() // releases the lock; nothing was written to the file
	return err
}

// StreamWorkers is how many long-lived goroutines of the agent's gRPC server handle its calls (a
// call finds them all busy: a goroutine of its own, as without them).
const StreamWorkers = 64

// GRPCServerOptions are the options the agent's gRPC server runs with (cmd/agent; the stack
// benchmark's empty handler uses them too, so it measures the same server).
func GRPCServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		// Gateways may keep their connections warm with pings (gRPC's default allows one every
		// five minutes and disconnects clients that ping more often).
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
		// A goroutine per call grows its stack through gRPC's server on every call; a worker's
		// stack stays grown (a tenth of the agent's CPU on unary checks of cold keys).
		grpc.NumStreamWorkers(StreamWorkers),
	}
}
