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
ENVD_PORT = 49983
GUEST_PYTHON = "3.11"  # Debian bookworm's python3: envd's wheels are chosen for this ABI
OPT = "/opt/aenv"
PYTHON_DIR = f"{OPT}/python"

# What the guest layer runs: sh + coreutils (init), iproute2 (ip), tini (PID 1), python3.
GUEST_RUNTIME_PACKAGES = ("coreutils", "iproute2", "python3", "tini")
# The base image: the guest layer plus what sandbox users expect (E2B's base has these).
BASE_PACKAGES = tuple(sorted({
    *GUEST_RUNTIME_PACKAGES,
    "bash",
    "ca-certificates",
    "kmod",  # modprobe for the cloud kernel's modules in /lib/modules
    "ncurses-bin",
    "procps",
    "sudo",
}))


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
