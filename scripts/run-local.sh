#!/usr/bin/env bash
# `make run`: a local stack in the foreground — a coordinator on its in-memory store (no Redis),
# an agent, the example gateway with the rate-limit filter, and a tiny upstream behind it, all
# reading examples/policy.yaml. Each process starts only once the one it needs is serving: the
# agent once the coordinator's gRPC health says SERVING, the gateway once the agent's does (and
# the upstream listens); the curl line below is printed once the gateway's /readyz says its agent
# answers, so a request made then is decided by the agent. Ctrl-C stops the gateway first, then
# the agent (it returns its leases to the coordinator), then the coordinator and the upstream.
#
#   coordinator  gRPC 127.0.0.1:7070, metrics http://127.0.0.1:7071/metrics
#   agent        socket out/run/agent.sock, metrics http://127.0.0.1:7072/metrics,
#                audit events (every deny, a sample of allows) in out/run/audit.log
#   gateway      http://127.0.0.1:8080 → upstream, metrics, /livez and /readyz on
#                http://127.0.0.1:7073
#   upstream     http://127.0.0.1:8081 (answers every request with a JSON line)
#
# The gateway's demo tokens are in out/run/tokens. Try it from a second terminal:
#   curl -i -H 'Authorization: Bearer demo-acme' http://127.0.0.1:8080/orders/7
#   go run ./cmd/lbcheck --agent-socket out/run/agent.sock -n 25 tenant=acme route=/orders/7 op=GET
#
# The directory and the addresses can be moved with the environment (defaults shown), for a
# second stack beside this one:
#   LEASEBUCKET_RUN_DIR=out/run
#   LEASEBUCKET_RUN_COORDINATOR=127.0.0.1:7070  LEASEBUCKET_RUN_COORDINATOR_METRICS=127.0.0.1:7071
#   LEASEBUCKET_RUN_AGENT_METRICS=127.0.0.1:7072
#   LEASEBUCKET_RUN_GATEWAY=127.0.0.1:8080      LEASEBUCKET_RUN_GATEWAY_METRICS=127.0.0.1:7073
#   LEASEBUCKET_RUN_UPSTREAM=127.0.0.1:8081
set -eu -o pipefail
cd "$(dirname "$0")/.."

dir=${LEASEBUCKET_RUN_DIR:-out/run}
coordinator_addr=${LEASEBUCKET_RUN_COORDINATOR:-127.0.0.1:7070}
coordinator_metrics=${LEASEBUCKET_RUN_COORDINATOR_METRICS:-127.0.0.1:7071}
agent_metrics=${LEASEBUCKET_RUN_AGENT_METRICS:-127.0.0.1:7072}
gateway_addr=${LEASEBUCKET_RUN_GATEWAY:-127.0.0.1:8080}
gateway_metrics=${LEASEBUCKET_RUN_GATEWAY_METRICS:-127.0.0.1:7073}
upstream_addr=${LEASEBUCKET_RUN_UPSTREAM:-127.0.0.1:8081}
policy=examples/policy.yaml
socket=$dir/agent.sock

mkdir -p "$dir"
go build -o "$dir/coordinator" ./cmd/coordinator
go build -o "$dir/agent" ./cmd/agent
go build -o "$dir/gateway" ./cmd/gateway
go build -o "$dir/upstream" ./cmd/gateway/upstream
go build -o "$dir/lbcheck" ./cmd/lbcheck

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
trap stop EXIT
trap 'stop; exit 0' INT TERM

# await NAME PID CHECK...: runs CHECK every 0.1 s until it succeeds. Fails (and the trap stops
# everything) if the process PID exits first, or after 30 s.
await() {
  local name=$1 pid=$2 i
  shift 2
  for ((i = 0; i < 300; i++)); do
    if "$@" >/dev/null 2>&1; then
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "leasebucket: the $name exited before it was ready" >&2
      return 1
    fi
    sleep 0.1
  done
  echo "leasebucket: the $name is not ready after 30 s" >&2
  return 1
}

# tcp_open HOST:PORT: whether HOST:PORT accepts a connection (bash's /dev/tcp; nothing is sent).
tcp_open() ( exec 3<>"/dev/tcp/${1%:*}/${1##*:}" )

# http_ok HOST:PORT PATH: whether GET http://HOST:PORT/PATH answers 200.
http_ok() (
  exec 3<>"/dev/tcp/${1%:*}/${1##*:}"
  printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$2" "$1" >&3
  read -r -t 5 _ status _ <&3
  [ "$status" = 200 ]
)

setsid "$dir/coordinator" --store memory --policy "$policy" \
  --listen "$coordinator_addr" --metrics-listen "$coordinator_metrics" &
coordinator=$!
await coordinator "$coordinator" "$dir/lbcheck" --health --agent-addr "$coordinator_addr" \
  --service leasebucket.coordinator.v1.CoordinatorService

setsid "$dir/agent" --coordinators "$coordinator_addr" --policy "$policy" --region eu-west \
  --socket "$socket" --metrics-listen "$agent_metrics" --log-format console \
  --audit-log "$dir/audit.log" &
agent=$!
await agent "$agent" "$dir/lbcheck" --health --agent-socket "$socket" --service leasebucket.agent.v1.AgentService

setsid "$dir/upstream" --listen "$upstream_addr" &
upstream=$!
await upstream "$upstream" tcp_open "$upstream_addr"

setsid "$dir/gateway" --listen "$gateway_addr" --upstream "http://$upstream_addr" \
  --agent-socket "$socket" --policy "$policy" --region eu-west --tokens "$dir/tokens" \
  --idempotency-header Idempotency-Key --metrics-listen "$gateway_metrics" --log-format console &
gateway=$!
await gateway "$gateway" http_ok "$gateway_metrics" /readyz

echo "leasebucket: coordinator (pid $coordinator), agent (pid $agent), gateway (pid $gateway) and upstream (pid $upstream) ready; Ctrl-C stops them." >&2
echo "leasebucket: try  curl -i -H 'Authorization: Bearer demo-acme' http://$gateway_addr/orders/7" >&2
# Stop everything as soon as any process ends (a failed start, a crash).
wait -n "$coordinator" "$agent" "$gateway" "$upstream" || true
