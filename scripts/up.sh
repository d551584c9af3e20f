#!/usr/bin/env bash
# Sets Kiln up on a Debian machine and serves it: Debian packages (as root; otherwise prints the apt-get line),
# Node 24 and the npm dependencies (npm ci), then `kiln serve` on http://127.0.0.1:8080.
# `scripts/up.sh --no-serve` stops after setting up (what .ci/run uses).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(runc runsc slirp4netns uidmap debootstrap tini iproute2 procps git ca-certificates postgresql)
# Any Node with npm will do to bootstrap: npm ci then brings Node 24 itself.
command -v npm >/dev/null 2>&1 || PACKAGES+=(nodejs npm)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "kiln: installing Debian packages: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "kiln: these Debian packages are missing; install them as root, then run this again:" >&2
    echo "  sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
fi

# Node 24 comes from the npm registry as a dependency (the `node` package), whatever Node the host has.
if [ ! -x node_modules/.bin/node ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --no-audit --no-fund
fi

if [ "${1:-}" = "--no-serve" ]; then exit 0; fi
exec node_modules/.bin/node src/cli/main.ts serve
