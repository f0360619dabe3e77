#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian/Ubuntu machine, run as root by `make run` and
# `make test`: Debian packages, the .venv with aenv and its test dependencies, and the
# JS SDK used by the tests. A second run only checks and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the project needs on the host. Keep sorted; say why in the commit.
APT_PACKAGES=(
  bc
  binutils
  bison
  ca-certificates
  cpio
  debootstrap
  e2fsprogs
  flex
  gcc
  iproute2
  libc6-dev        # headers of aenv/runtime/track_writes.c (built on first use with gcc)
  libelf-dev
  lz4
  make
  nfs-ganesha      # volumes: a userspace NFS server per sandbox (aenv/storage/volume_server.py)
  nfs-ganesha-vfs  # its VFS backend (exports a host directory)
  nftables
  procps
  qemu-system-x86
  qemu-utils
  sudo
  xfsprogs
  zstd
)

# Debian packages only the tests need (deploy/host-packages.sh does not list them).
TEST_APT_PACKAGES=(
  apache2-utils    # htpasswd: the auth registry of tests/local_registry.py
  dnsmasq-base     # tests/server/test_tls_e2e.py: a resolver for *.aenv.test (no service)
  docker-registry  # tests/local_registry.py: a real OCI registry on loopback
  redis-server     # tests/cluster: a real Redis on loopback (started by the tests, no service)
  skopeo           # tests/local_registry.py: pushes the test images
  umoci            # tests/local_registry.py: makes the test images (OCI layouts)
)

missing=()
for pkg in "${APT_PACKAGES[@]}" "${TEST_APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  missing+=(nodejs npm)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then echo "setup: run as root to install packages" >&2; exit 1; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.aenv-setup
want=$(cat pyproject.toml aenv/requirements.txt aenv/envd/requirements.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python dependencies into .venv"
  # The mirror's empty extra index makes pip warn once per package; keep real errors.
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 \
    | { grep -v "^WARNING: Location 'file:///opt/" || true; }
  echo "$want" > "$stamp"
fi

# The oldest E2B Python SDK we promise to serve (v1 create/connect), in its own venv so it
# never meets the pinned one.
old=.venv-e2b-2.7
owant=e2b==2.7.0
if [ "$(cat $old/.aenv-setup 2>/dev/null)" != "$owant" ]; then
  echo "setup: installing $owant (the oldest supported SDK) for the tests"
  "$PYTHON" -m venv $old
  $old/bin/pip install -q --disable-pip-version-check "$owant" 2>&1 \
    | { grep -v "^WARNING: Location 'file:///opt/" || true; }
  echo "$owant" > $old/.aenv-setup
fi

js=tests/js
jstamp=$js/node_modules/.aenv-setup
jwant=$(cat $js/package.json | sha256sum | cut -d' ' -f1)
if [ "$(cat "$jstamp" 2>/dev/null)" != "$jwant" ]; then
  echo "setup: installing the E2B JS SDK (newest) for the tests"
  (cd $js && npm install --no-audit --no-fund --loglevel=error >/dev/null)
  echo "$jwant" > "$jstamp"
fi
