#!/usr/bin/env bash
# `make run`: a local stack in the foreground — a coordinator on its in-memory store (no Redis),
# an agent, the example gateway with the rate-limit filter, and a tiny upstream behind it, all
# reading examples/policy.yaml. Ctrl-C stops the gateway first, then the agent (it returns its
# leases to the coordinator), then the coordinator and the upstream.
#
#   coordinator  gRPC 127.0.0.1:7070, metrics http://127.0.0.1:7071/metrics
#   agent        socket out/run/agent.sock, metrics http://127.0.0.1:7072/metrics,
#                audit events (every deny, a sample of allows) in out/run/audit.log
#   gateway      http://127.0.0.1:8080 → upstream, metrics http://127.0.0.1:7073/metrics
#   upstream     http://127.0.0.1:8081 (answers every request with a JSON line)
#
# The gateway's demo tokens are in out/run/tokens. Try it from a second terminal:
#   curl -i -H 'Authorization: Bearer demo-acme' http://127.0.0.1:8080/orders/7
#   go run ./cmd/lbcheck -socket out/run/agent.sock -n 25 tenant=acme route=/orders/7 op=GET
set -eu -o pipefail
cd "$(dirname "$0")/.."

dir=out/run
policy=examples/policy.yaml
mkdir -p "$dir"
go build -o "$dir/coordinator" ./cmd/coordinator
go build -o "$dir/agent" ./cmd/agent
go build -o "$dir/gateway" ./cmd/gateway
go build -o "$dir/upstream" ./cmd/gateway/upstream

# Demo bearer tokens → tenants (acme has the policy's default limits, bigcorp and trial-co
# tenant overrides). A real deployment keeps real secrets elsewhere, with mode 0600.
cat >"$dir/tokens" <<'EOF'
# TOKEN         TENANT
demo-acme       acme
demo-bigcorp    bigcorp
demo-trial      trial-co
EOF
chmod 600 "$dir/tokens"

# setsid detaches each from the terminal, so Ctrl-C reaches this script only and the
# shutdown happens in order.
coordinator=0 agent=0 gateway=0 upstream=0
stop_one() {
  if [ "$1" -ne 0 ]; then kill -TERM "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; fi
}
stop() {
  trap - INT TERM EXIT
  stop_one "$gateway"
  stop_one "$agent"
  stop_one "$coordinator"
  stop_one "$upstream"
}
trap stop INT TERM EXIT

setsid "$dir/coordinator" --store memory --policy "$policy" \
  --listen 127.0.0.1:7070 --metrics-listen 127.0.0.1:7071 &
coordinator=$!
setsid "$dir/agent" --coordinators 127.0.0.1:7070 --policy "$policy" --region eu-west \
  --socket "$dir/agent.sock" --metrics-listen 127.0.0.1:7072 --log-format console \
  --audit-log "$dir/audit.log" &
agent=$!
setsid "$dir/upstream" --listen 127.0.0.1:8081 &
upstream=$!
setsid "$dir/gateway" --listen 127.0.0.1:8080 --upstream http://127.0.0.1:8081 \
  --agent-socket "$dir/agent.sock" --policy "$policy" --region eu-west --tokens "$dir/tokens" \
  --idempotency-header Idempotency-Key --metrics-listen 127.0.0.1:7073 --log-format console &
gateway=$!

echo "leasebucket: coordinator (pid $coordinator), agent (pid $agent), gateway (pid $gateway) and upstream (pid $upstream) running; Ctrl-C stops them." >&2
echo "leasebucket: try  curl -i -H 'Authorization: Bearer demo-acme' http://127.0.0.1:8080/orders/7" >&2
# Stop everything as soon as any process ends (a failed start, a crash).
wait -n "$coordinator" "$agent" "$gateway" "$upstream" || true
