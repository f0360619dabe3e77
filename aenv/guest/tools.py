"""The recipe of the tools drive: envd with its own runtime, for images that bring nothing.

Data only; ``aenv.storage.tools_drive`` builds the drive. A guest whose image has no guest
layer of its own (busybox, alpine, a Debian without Python...) boots with a second,
read-only virtio-blk drive that the cloud initramfs mounts at ``PREFIX`` (``/.aenv``) in the
image's root before it switch_roots to ``INIT``. Everything envd needs comes from there:

- ``bin/busybox`` (static) and a few applet links for the init scripts, ``bin/tini``
  (tini-static) as PID 1's reaper, ``bin/setpriv`` (util-linux, run through the tools'
  loader: envd's user switch never depends on the image's ``setpriv``, which may be
  busybox's, with other options);
- ``lib/``: glibc's dynamic loader and every shared library the interpreter, its
  ``lib-dynload`` modules, envd's compiled dependencies and ``setpriv`` need (from their ELF
  ``DT_NEEDED`` entries), and ``lib/python3.11``: the standard library without what envd
  never imports (``STDLIB_DROP``), byte-compiled;
- ``python/``: envd's dependencies and the ``aenv`` package's envd part, as in the base
  image's ``/opt/aenv/python``, byte-compiled;
- ``bin/aenv-init``, ``bin/envd-supervise`` (busybox sh scripts) and ``bin/envd`` (the
  launcher shared with the base image).

Python runs as ``PYTHON_ARGV``: the tools' own loader with ``--library-path`` (no
``LD_LIBRARY_PATH``, so nothing reaches processes envd starts, whose environment envd builds
from scratch anyway), ``--inhibit-cache`` (the image's ``/etc/ld.so.cache`` is never read),
``-I -S`` (no ``PYTHON*`` variables, no site-packages: the interpreter's prefix is
``PREFIX``, found from its own path, so the image's ``/usr/lib/python3*`` is never read).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

from . import base

PREFIX = "/.aenv"
INIT = f"{PREFIX}/bin/aenv-init"
LOADER = f"{PREFIX}/lib/ld-linux-x86-64.so.2"
LIBRARY_PATH = f"{PREFIX}/lib"
PYTHON = f"{PREFIX}/bin/python{base.GUEST_PYTHON}"
PYTHON_DIR = f"{PREFIX}/python"  # envd's site and sources: the launcher finds it beside itself
LAUNCHER = f"{PREFIX}/bin/envd"
SETPRIV = f"{PREFIX}/bin/setpriv"
# The kernel command-line parameter naming the tools drive, read by the cloud initramfs.
BOOT_PARAM = "aenv.tools"
TOOLS_DEVICE = "/dev/vdb"  # the second virtio-blk drive: the root disk is always the first
# The environment variable through which envd learns how to run the tools' setpriv
# (``aenv.envd.process.launch``): an argv prefix, words separated by spaces.
SETPRIV_ENV = "AENV_ENVD_SETPRIV"

# What a login shell, a command and envd's children get as PATH (the image's own tools
# only: the tools drive is not on it).
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

PYTHON_ARGV = (LOADER, "--inhibit-cache", "--library-path", LIBRARY_PATH, PYTHON, "-I", "-S")
SETPRIV_ARGV = (LOADER, "--inhibit-cache", "--library-path", LIBRARY_PATH, SETPRIV)

# Busybox applets the init scripts call by name (busybox sh runs its own applets first).
BUSYBOX_APPLETS = ("sh", "mount", "mkdir", "ln", "ip", "sleep", "cat", "hostname")

# Parts of the standard library envd never imports (tests, GUIs, installers, docs data,
# 2to3); dropped from the drive. ``__pycache__`` of the source tree is rebuilt.
STDLIB_DROP = (
    "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
    "distutils/tests", "unittest/test", "sqlite3/test", "ctypes/test", "tkinter/test",
    "config-3.11-x86_64-linux-gnu", "turtle.py", "__phello__",
)
# Debian packages (besides the interpreter, from the base image's Debian tree) that the
# drive takes its static binaries from, and the file of each.
STATIC_TOOLS = (("busybox-static", "bin/busybox", "bin/busybox"),
                ("tini", "usr/bin/tini-static", "bin/tini"))


@dataclass(frozen=True)
class ToolsFile:
    path: str  # relative to the drive's root (``PREFIX`` in the guest)
    data: bytes
    mode: int


def scripts() -> list[ToolsFile]:
    """The init, the supervisor and envd's launcher, as they go on the drive."""
    files = resources.files("aenv.guest").joinpath("files")
    return [
        ToolsFile("bin/aenv-init", files.joinpath("tools-init.sh").read_bytes(), 0o755),
        ToolsFile("bin/envd-supervise", files.joinpath("tools-supervise.sh").read_bytes(),
                  0o755),
        ToolsFile("bin/envd", files.joinpath("envd_launcher.py").read_bytes(), 0o644),
    ]


def recipe_digest() -> str:
    """sha256 over what the drive's layout depends on besides its inputs' contents (these
    constants and the scripts), so a change to either names a new drive."""
    h = hashlib.sha256()
    for f in scripts():
        h.update(f"file {f.path} {f.mode:o} {len(f.data)}\n".encode())
        h.update(f.data)
    for value in (PREFIX, PYTHON_ARGV, SETPRIV_ARGV, BUSYBOX_APPLETS, STDLIB_DROP, STATIC_TOOLS):
        h.update(repr(value).encode() + b"\n")
    return h.hexdigest()
