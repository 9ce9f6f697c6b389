#!/usr/bin/env bash
# Makes sure redis-server and redis-cli are on PATH: the test suite starts its own Redis
# processes (standalone, Cluster, Sentinel) on free ports. Installs Debian's redis-server package
# when run as root; otherwise says how to install it and fails.
set -eu -o pipefail

have() { command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; }

if have; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "redis-server not found: installing Debian's redis-server package" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
  # The package may start a system Redis on 6379; the tests never use it.
  have && exit 0
fi
cat >&2 <<'MSG'
redis-server and redis-cli are needed by the tests (Sentinel runs as redis-server --sentinel).
Install them with:  sudo apt-get install -y redis-server redis-tools
(on macOS: brew install redis). Then run make test again.
MSG
exit 1
