#!/usr/bin/env bash
# Sets Kiln up on a Debian machine and serves it: Debian packages (as root; otherwise prints the apt-get line),
# Node 24 and the npm dependencies (npm ci), then `kiln serve` on http://127.0.0.1:8080.
# `scripts/up.sh --no-serve` stops after setting up (what .ci/run uses).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(runc slirp4netns uidmap debootstrap tini iproute2 procps git ca-certificates postgresql util-linux openssh-server e2fsprogs inotify-tools nftables xfsprogs curl jq)
# attr (getfattr/setfattr): the agent bundle test checks, from outside the agent, the user.e2b.* xattrs it keeps file metadata in.
PACKAGES+=(attr)
# chromium: the console's tests and benchmarks drive the web console in real headless Chromium (puppeteer-core).
PACKAGES+=(chromium)
# python3: the Python SDK (sdk/python, standard library only) is tested with Debian's own interpreter.
PACKAGES+=(python3)
# openssh-server: the git tests start their own sshd (own config and port on 127.0.0.1) as an SSH git remote.
# Image imports and Dockerfile builds: xattrs on layer dirs (attr), the embedded Dockerfile builder (buildah), and
# what the tests and benchmarks run against (a loopback registry with bcrypt htpasswd, skopeo as the baseline).
PACKAGES+=(attr buildah skopeo docker-registry apache2-utils)
# The mount helper (src/runtime/oci/idmount.c) is compiled at first start: it gives each machine its own host uid
# range through idmapped mounts, which runc 1.1 and util-linux 2.38 cannot make.
PACKAGES+=(gcc libc6-dev)
# The Dockerfile isolation tests build FROM an image made of Debian's static busybox (ps, kill, nc, … in one file).
PACKAGES+=(busybox-static)
# The metrics test scrapes GET /metrics with a real Prometheus (its own config, port and data dir on 127.0.0.1).
PACKAGES+=(prometheus)
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

# gVisor: Kiln needs runsc 20240729 or newer (bookworm's own 20221219 cannot network on Linux 6.x, nor stat with
# AT_NO_AUTOMOUNT as coreutils does). Debian has it in bookworm-backports and in trixie and later.
RUNSC_MIN=20240729
runsc_version() { runsc --version 2>/dev/null | sed -n 's/.*[~-]\([0-9]\{8\}\).*/\1/p' | head -1; }
if [ "$(runsc_version || true)" \< "$RUNSC_MIN" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "kiln: gVisor's runsc $RUNSC_MIN or newer is missing; run this script as root once, or add bookworm-backports" >&2
    echo "  to apt's sources and: sudo apt-get install -y -t bookworm-backports runsc" >&2
    exit 1
  fi
  . /etc/os-release
  export DEBIAN_FRONTEND=noninteractive
  if [ "${VERSION_CODENAME:-}" = bookworm ]; then
    if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
      # The same mirror the host already uses for bookworm.
      mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null | grep -v -e '^[[:space:]]*#' -e security | grep -oE 'https?://[^ ]+/debian/?' | head -1 || true)
      printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        "${mirror:-http://deb.debian.org/debian}" > /etc/apt/sources.list.d/kiln-bookworm-backports.sources
    fi
    echo "kiln: installing runsc from bookworm-backports" >&2
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends -t bookworm-backports runsc >/dev/null
  else
    apt-get install -y -qq --no-install-recommends runsc >/dev/null
  fi
  if [ "$(runsc_version || true)" \< "$RUNSC_MIN" ]; then
    echo "kiln: runsc $(runsc_version) is older than $RUNSC_MIN; gVisor machines will not work" >&2
    exit 1
  fi
fi

# Node 24 comes from the npm registry as a dependency (the `node` package), whatever Node the host has.
if [ ! -x node_modules/.bin/node ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --no-audit --no-fund
fi

# The web console (/console) is bundled from console/ into dist/console: never committed, always built here.
node_modules/.bin/node scripts/build-console.ts

if [ "${1:-}" = "--no-serve" ]; then exit 0; fi
exec bin/kiln serve
