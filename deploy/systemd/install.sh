#!/usr/bin/env bash
# Install aenv as a systemd service on a Debian 12 / Ubuntu host, from this checkout or a
# wheel: the Debian packages (deploy/host-packages.sh), a venv in /opt/aenv, the unit
# /etc/systemd/system/aenv.service and its settings /etc/default/aenv (kept when present),
# the cluster gateway's unit aenv-gateway.service and /etc/default/aenv-gateway (written,
# not enabled), then `systemctl daemon-reload` and `enable` (aenv.service only). It
# never starts or restarts a service.
# Running it again upgrades aenv in place. --dry-run prints the plan and changes nothing.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

usage() {
  cat <<EOF
usage: $0 [--dry-run] [--wheel FILE] [--prefix DIR] [--skip-packages] [--root DIR]

  --dry-run        print every step that would change the host; change nothing
  --wheel FILE     install this aenv wheel instead of the checkout at $repo
  --prefix DIR     where the venv goes (default /opt/aenv)
  --skip-packages  do not install Debian packages (you manage them)
  --root DIR       install below DIR instead of / (a staging tree, e.g. for tests):
                   implies --skip-packages, never calls systemctl; the venv's scripts
                   name DIR/PREFIX, so the tree is not relocatable
  PYTHON=...       interpreter for the venv (default /usr/bin/python3, >= 3.11)
EOF
}

dry=0 prefix=/opt/aenv wheel="" skip_packages=0 root=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --wheel) wheel=${2:?--wheel needs a file}; shift ;;
    --prefix) prefix=${2:?--prefix needs a directory}; shift ;;
    --skip-packages) skip_packages=1 ;;
    --root) root=${2:?--root needs a directory}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install: unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
[ -n "$root" ] && { root=$(realpath -m "$root"); skip_packages=1; }
PYTHON=${PYTHON:-/usr/bin/python3}
venv="$root$prefix"
unit="$root/etc/systemd/system/aenv.service"
envfile="$root/etc/default/aenv"
gateway_unit="$root/etc/systemd/system/aenv-gateway.service"
gateway_envfile="$root/etc/default/aenv-gateway"

say() { echo "install: $*"; }
warn() { echo "install: warning: $*" >&2; }
die() { echo "install: error: $*" >&2; exit 1; }

# Every command that changes the host goes through `run`; in a dry run it is only printed.
run() {
  if [ "$dry" = 1 ]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

# write SRC DEST MODE: copy a file; the unit also gets the prefix substituted.
write() {
  local src=$1 dest=$2 mode=$3
  if [ "$dry" = 1 ]; then
    say "would write $dest (mode $mode) from ${src#"$repo"/}"
    return
  fi
  mkdir -p "$(dirname "$dest")"
  sed "s#/opt/aenv#$prefix#g" "$src" > "$dest.tmp.$$"
  chmod "$mode" "$dest.tmp.$$"
  mv -f "$dest.tmp.$$" "$dest"
}

check_host() {
  [ "$(uname -s)" = Linux ] || die "aenv runs on Linux only"
  local release major minor
  release=$(uname -r)
  major=${release%%.*}; minor=${release#*.}; minor=${minor%%[!0-9]*}
  if [ "$major" -lt 6 ] || { [ "$major" -eq 6 ] && [ "${minor:-0}" -lt 8 ]; }; then
    warn "kernel $release: aenv targets Linux 6.8+; older kernels are untested"
  fi
  if [ ! -c /dev/kvm ]; then
    warn "no /dev/kvm: guests will run under QEMU TCG (software emulation, slow boots)"
  fi
  [ -c /dev/net/tun ] || warn "no /dev/net/tun: sandboxes need tap devices (modprobe tun)"
  if [ "$dry" = 0 ] && [ -z "$root" ] && [ "$(id -u)" -ne 0 ]; then
    die "run as root (or with --dry-run / --root DIR)"
  fi
}

install_packages() {
  local pkgs missing=()
  pkgs=$("$repo/deploy/host-packages.sh")
  if [ "$skip_packages" = 1 ]; then
    say "skipping Debian packages; this host needs: $(echo "$pkgs" | tr '\n' ' ')"
    return
  fi
  for pkg in $pkgs; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
      || missing+=("$pkg")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    say "Debian packages: all present"
    return
  fi
  say "Debian packages to install: ${missing[*]}"
  run apt-get update -qq
  run env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}"
}

install_venv() {
  if [ ! -x "$venv/bin/python" ]; then
    say "creating the venv $venv with $PYTHON"
    run "$PYTHON" -m venv "$venv"
  fi
  if [ -n "$wheel" ]; then
    [ -f "$wheel" ] || die "no such wheel: $wheel"
    say "installing $wheel into $venv"
    run "$venv/bin/pip" install -q --disable-pip-version-check --upgrade "$wheel"
  else
    say "installing aenv from $repo into $venv"
    if [ "$dry" = 1 ]; then
      echo "+ $venv/bin/pip install -q --disable-pip-version-check --upgrade <copy of $repo>"
    else
      # Build from a copy of just the package, so the checkout gets no build/ directory
      # and no development files (.venv, tests) end up in the wheel.
      stage=$(mktemp -d)
      trap 'rm -rf "$stage"' EXIT
      tar -C "$repo" -cf - --exclude=__pycache__ pyproject.toml README.md aenv \
        | tar -C "$stage" -xf -
      "$venv/bin/pip" install -q --disable-pip-version-check --upgrade "$stage"
    fi
  fi
}

install_files() {
  write "$repo/deploy/bin/aenv-drain" "$venv/bin/aenv-drain" 0755
  write "$repo/docs/install.md" "$venv/share/doc/aenv/install.md" 0644
  run mkdir -p "$root/usr/local/bin"
  for cmd in aenv aenv-drain; do
    run ln -sfn "$prefix/bin/$cmd" "$root/usr/local/bin/$cmd"
  done
  write "$here/aenv.service" "$unit" 0644
  if [ -e "$envfile" ]; then
    say "keeping $envfile (yours); the template is $here/aenv.env"
  else
    # 0600: it may get AENV_API_KEY.
    write "$here/aenv.env" "$envfile" 0600
  fi
  # The cluster gateway (docs/install.md, "Many nodes"): written, never enabled here.
  write "$here/aenv-gateway.service" "$gateway_unit" 0644
  if [ -e "$gateway_envfile" ]; then
    say "keeping $gateway_envfile (yours); the template is $here/aenv-gateway.env"
  else
    write "$here/aenv-gateway.env" "$gateway_envfile" 0600
  fi
}

enable_service() {
  if [ -n "$root" ]; then
    say "staged below $root; systemctl not called"
  elif [ -d /run/systemd/system ]; then
    run systemctl daemon-reload
    run systemctl enable aenv.service
    if systemctl is-active --quiet aenv.service; then
      say "aenv is running the old version: systemctl restart aenv (sandboxes are re-attached)"
    else
      say "enabled, not started: systemctl start aenv; logs: journalctl -u aenv -f"
    fi
  else
    say "systemd is not PID 1 here: the unit file is written, not enabled. The equivalent"
    say "of the unit, to run from an init script or by hand as root:"
    cat <<EOF
  mkdir -p -m 0700 /var/lib/aenv
  ( export AENV_HOME=/var/lib/aenv; set -a; . /etc/default/aenv; set +a
    ulimit -n 1048576; ulimit -l unlimited
    exec setsid $prefix/bin/aenv server ) >>/var/log/aenv.log 2>&1 </dev/null &
EOF
  fi
}

check_host
[ "$dry" = 1 ] && say "dry run: nothing below is done"
install_packages
install_venv
install_files
enable_service
say "API key: \$AENV_HOME/secrets/api-key (default /var/lib/aenv), written on first start"
