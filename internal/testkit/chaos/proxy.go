package chaos

import (
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Mode is what a Proxy does to the traffic through it.
type Mode int

const (
	// Pass forwards everything at once.
	Pass Mode = iota
	// Delay forwards every chunk of bytes, in both directions, its delay after it arrived: one
	// added latency per direction, without limiting throughput or reordering bytes.
	Delay
	// Blackhole keeps every connection open and accepts new ones, but forwards nothing: a peer
	// that hangs. What arrived meanwhile is forwarded when the mode changes, unless its
	// connection was closed first (a client that gave up), in which case it is dropped.
	Blackhole
	// Cut closes every connection and closes new ones as soon as they are accepted: a peer that
	// is gone, or a network that resets.
	Cut
)

func (m Mode) String() string {
	switch m {
	case Pass:
		return "pass"
	case Delay:
		return "delay"
	case Blackhole:
		return "blackhole"
	case Cut:
		return "cut"
	}
	return "unknown"
}

// chunkQueue bounds the chunks a direction holds before its reader stops reading (TCP flow
// control then stops the sender): enough for any pipelined batch the harness produces.
const chunkQueue = 1024

// dialTimeout bounds the proxy's connection to its target. A target that does not accept in time
// is down: the client's connection is closed, as a refused connection would be.
const dialTimeout = time.Second

// Proxy is a TCP proxy the harness controls: processes reach a peer through it (coordinators
// their Redis, agents their coordinators), and a fault changes its Mode. The target never
// changes, so a peer restarted on its port is reached again. It is safe for concurrent use.
type Proxy struct {
	name   string
	target string
	ln     net.Listener

	mu      sync.Mutex
	mode    Mode
	delay   time.Duration
	changed chan struct{} // closed and replaced at every mode change
	links   map[*link]struct{}
	closed  bool

	wg sync.WaitGroup

	accepted, cut atomic.Int64
}

// NewProxy listens on a free port of 127.0.0.1 and forwards to target.
func NewProxy(name, target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{name: name, target: target, ln: ln, changed: make(chan struct{}), links: map[*link]struct{}{}}
	p.wg.Go(p.accept)
	return p, nil
}

// Addr is the address clients dial.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Port is the port clients dial.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// Name names the proxy in reports.
func (p *Proxy) Name() string { return p.name }

// Mode returns the current mode and delay.
func (p *Proxy) Mode() (Mode, time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mode, p.delay
}

// Set changes the mode; delay is used by Delay. Cut closes every open connection before it
// returns.
func (p *Proxy) Set(m Mode, delay time.Duration) {
	p.mu.Lock()
	p.mode, p.delay = m, delay
	close(p.changed)
	p.changed = make(chan struct{})
	var victims []*link
	if m == Cut {
		for l := range p.links {
			victims = append(victims, l)
		}
	}
	p.mu.Unlock()
	for _, l := range victims {
		p.cut.Add(1)
		l.close()
	}
}

// Stats reports the connections accepted and those closed by Cut.
func (p *Proxy) Stats() (accepted, cut int64) { return p.accepted.Load(), p.cut.Load() }

// Close stops the proxy and closes every connection.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	close(p.changed)
	p.changed = make(chan struct{})
	p.mu.Unlock()
	_ = p.ln.Close()
	for _, l := range links {
		l.close()
	}
	p.wg.Wait()
}

// state is the mode a forwarder acts on, and the channel closed when it changes.
func (p *Proxy) state() (Mode, time.Duration, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mode, p.delay, p.changed
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		p.accepted.Add(1)
		if m, _, _ := p.state(); m == Cut {
			p.cut.Add(1)
			_ = c.Close()
			continue
		}
		p.wg.Go(func() { p.serve(c) })
	}
}

// serve connects c to the target and forwards both ways until either side closes.
func (p *Proxy) serve(c net.Conn) {
	up, err := net.DialTimeout("tcp", p.target, dialTimeout)
	if err != nil {
		_ = c.Close()
		return
	}
	l := &link{a: c, b: up, done: make(chan struct{})}
	p.mu.Lock()
	if p.closed || p.mode == Cut {
		p.mu.Unlock()
		l.close()
		return
	}
	p.links[l] = struct{}{}
	p.mu.Unlock()
	var wg sync.WaitGroup
	wg.Go(func() { p.forward(l, c, up) })
	wg.Go(func() { p.forward(l, up, c) })
	wg.Wait()
	p.mu.Lock()
	delete(p.links, l)
	p.mu.Unlock()
}

// link is one proxied connection: its two sides close together.
type link struct {
	a, b net.Conn
	once sync.Once
	done chan struct{}
}

func (l *link) close() {
	l.once.Do(func() {
		close(l.done)
		_ = l.a.Close()
		_ = l.b.Close()
	})
}

type chunk struct {
	data []byte
	at   time.Time
}

// forward copies src to dst through a queue: a reader stamps each chunk as it arrives, a writer
// sends it when the mode allows (Delay: its delay after the stamp). Either side failing closes
// the link, and what is still queued is dropped.
func (p *Proxy) forward(l *link, src, dst net.Conn) {
	q := make(chan chunk, chunkQueue)
	go func() {
		defer close(q)
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				select {
				case q <- chunk{data: buf[:n], at: time.Now()}:
				case <-l.done:
					return
				}
			}
			if err != nil {
				l.close()
				return
			}
		}
	}()
	defer func() {
		l.close()
		for range q { // let the reader finish
		}
	}()
	for c := range q {
		if !p.hold(l, c.at) {
			return
		}
		if _, err := dst.Write(c.data); err != nil {
			return
		}
	}
}

// hold waits until a chunk that arrived at may be written: at once in Pass, its delay after
// arriving in Delay, not before the mode changes in Blackhole. It reports false when the link
// closed meanwhile.
func (p *Proxy) hold(l *link, at time.Time) bool {
	for {
		m, d, changed := p.state()
		switch m {
		case Pass:
			return !l.isClosed()
		case Delay:
			wait := time.Until(at.Add(d))
			if wait <= 0 {
				return !l.isClosed()
			}
			t := time.NewTimer(wait)
			select {
			case <-t.C:
				return !l.isClosed()
			case <-changed:
				t.Stop()
			case <-l.done:
				t.Stop()
				return false
			}
		case Blackhole:
			select {
			case <-changed:
			case <-l.done:
				return false
			}
		default: // Cut closed the link
			return false
		}
	}
}

func (l *link) isClosed() bool {
	select {
	case <-l.done:
		return true
	default:
		return false
	}
}
