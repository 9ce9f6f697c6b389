package client

import "testing"

func TestDialAddr(t *testing.T) {
	tests := []struct {
		target, network, addr string
	}{
		{"unix:/run/leasebucket/agent.sock", "unix", "/run/leasebucket/agent.sock"},
		{"unix:out/run/agent.sock", "unix", "out/run/agent.sock"},
		{"unix:///run/leasebucket/agent.sock", "unix", "/run/leasebucket/agent.sock"},
		{"127.0.0.1:7074", "tcp", "127.0.0.1:7074"},
		{"dns:///agent.local:7074", "tcp", "agent.local:7074"},
		{"dns://10.0.0.53/agent.local:7074", "tcp", "agent.local:7074"},
		{"passthrough:///[::1]:7074", "tcp", "[::1]:7074"},
		{"dns:///agent.local", "", ""}, // no port: gRPC's default, not guessed here
		{"xds:///agent", "", ""},
		{"unix-abstract:agent", "", ""},
	}
	for _, tt := range tests {
		if network, addr := dialAddr(tt.target); network != tt.network || addr != tt.addr {
			t.Errorf("dialAddr(%q) = %q, %q, want %q, %q", tt.target, network, addr, tt.network, tt.addr)
		}
	}
}
