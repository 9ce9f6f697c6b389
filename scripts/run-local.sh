#!/usr/bin/env bash
# `make run`: a local stack in the foreground — a coordinator on its in-memory store (no Redis)
# and an agent, both reading examples/policy.yaml. Ctrl-C stops the agent first (it returns its
# leases to the coordinator), then the coordinator.
#
#   coordinator  gRPC 127.0.0.1:7070, metrics http://127.0.0.1:7071/metrics
#   agent        socket out/run/agent.sock, metrics http://127.0.0.1:7072/metrics
#
# Try it from a second terminal:
#   go run ./cmd/lbcheck -socket out/run/agent.sock -n 25 tenant=acme route=/orders/7 op=GET
set -eu -o pipefail
cd "$(dirname "$0")/.."

dir=out/run
policy=examples/policy.yaml
mkdir -p "$dir"
go build -o "$dir/coordinator" ./cmd/coordinator
go build -o "$dir/agent" ./cmd/agent

# setsid detaches each from the terminal, so Ctrl-C reaches this script only and the
# shutdown happens in order.
coordinator=0 agent=0
stop() {
  trap - INT TERM EXIT
  if [ "$agent" -ne 0 ]; then kill -TERM "$agent" 2>/dev/null || true; wait "$agent" 2>/dev/null || true; fi
  if [ "$coordinator" -ne 0 ]; then kill -TERM "$coordinator" 2>/dev/null || true; wait "$coordinator" 2>/dev/null || true; fi
}
trap stop INT TERM EXIT

setsid "$dir/coordinator" --store memory --policy "$policy" \
  --listen 127.0.0.1:7070 --metrics-listen 127.0.0.1:7071 &
coordinator=$!
setsid "$dir/agent" --coordinators 127.0.0.1:7070 --policy "$policy" --region eu-west \
  --socket "$dir/agent.sock" --metrics-listen 127.0.0.1:7072 --log-format console &
agent=$!

echo "leasebucket: coordinator (pid $coordinator) and agent (pid $agent) running; Ctrl-C stops both." >&2
echo "leasebucket: try  go run ./cmd/lbcheck -socket $dir/agent.sock -n 25 tenant=acme route=/orders/7 op=GET" >&2
# Stop everything as soon as either process ends (a failed start, a crash).
wait -n "$coordinator" "$agent" || true
