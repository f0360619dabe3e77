#!/usr/bin/env bash
# Prints, one a line, the Debian packages an aenv host needs. The list is scripts/setup.sh's
# APT_PACKAGES — the one list, which development and CI install too — plus what a host
# without a development checkout lacks: python3 and its venv module. Read by
# deploy/systemd/install.sh and deploy/docker/Dockerfile; it installs nothing itself.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
setup="$here/../scripts/setup.sh"
# Only the array's lines are evaluated: sourcing setup.sh would run the set-up.
block=$(sed -n '/^APT_PACKAGES=(/,/^)/p' "$setup")
if [ -z "$block" ]; then
  echo "host-packages: no APT_PACKAGES=( ... ) block in $setup" >&2
  exit 1
fi
eval "$block"
printf '%s\n' "${APT_PACKAGES[@]}" python3 python3-venv
