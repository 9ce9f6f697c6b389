#!/usr/bin/env bash
# Makes sure the tools that check the deployment files are at hand (deploy/deploy_test.go runs
# them):
#   promtool        checks and unit-tests the Prometheus alert rules. Debian's prometheus package
#                   ships it; its binary is unpacked into out/tools/bin, so that installing it
#                   neither needs root nor starts a Prometheus server.
#   systemd-analyze verifies the systemd units (Debian's systemd package); systemd-sysusers
#                   checks the sysusers.d file.
# When a tool is missing and cannot be had this way, it says how to install it and fails.
set -eu -o pipefail
cd "$(dirname "$0")/.."

bin=out/tools/bin
mkdir -p "$bin"
status=0

have() { command -v "$1" >/dev/null 2>&1 || [ -x "$bin/$1" ]; }
root() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }

# unpack_promtool extracts usr/bin/promtool from Debian's prometheus package into $bin.
unpack_promtool() {
  command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1 || return 1
  local tmp
  tmp=$(mktemp -d)
  if ! (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1); then
    root || { rm -rf "$tmp"; return 1; }
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    (cd "$tmp" && apt-get download -qq prometheus >/dev/null) || { rm -rf "$tmp"; return 1; }
  fi
  dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root"
  install -m 0755 "$tmp/root/usr/bin/promtool" "$bin/promtool"
  rm -rf "$tmp"
}

if ! have promtool; then
  echo "promtool not found: unpacking it from Debian's prometheus package into $bin" >&2
  if ! unpack_promtool; then
    cat >&2 <<'MSG'
promtool is needed to check the alert rules (deploy/prometheus). Install it with
  sudo apt-get install -y prometheus       (Debian, Ubuntu; or put promtool from a Prometheus
                                            release on PATH)
MSG
    status=1
  fi
fi

if ! have systemd-analyze || ! have systemd-sysusers; then
  if root; then
    echo "systemd-analyze not found: installing Debian's systemd package" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null
  fi
  if ! have systemd-analyze || ! have systemd-sysusers; then
    cat >&2 <<'MSG'
systemd-analyze and systemd-sysusers are needed to verify the systemd units (deploy/systemd).
Install them with:  sudo apt-get install -y systemd
MSG
    status=1
  fi
fi
exit $status
