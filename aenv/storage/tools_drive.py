"""The tools drive: envd and its own runtime on a read-only ext4 image shared by every VM.

Built once per aenv version (``aenv.guest.tools`` says what it holds) and named by the
digest of its inputs: the base image's Debian tree (the interpreter, its standard library,
the shared libraries and loader, ``setpriv``), the busybox-static and tini packages,
envd's dependencies, envd's sources and the tools recipe. It lives at
``<artifacts>/tools/<digest>/tools.ext4`` (mode 0444) beside a ``tools.json`` manifest,
and is never written or deleted by aenv once made: VMs attach it read-only, and the
snapshots of those VMs name it by path, so an old drive stays for as long as its snapshots
may be restored (a new aenv makes a new one beside it).

The runtime part (interpreter, standard library byte-compiled, libraries, static tools),
which only changes with the Debian tree, is cached as a tree under
``<cache>/tools-runtime/<key>``; a change to envd only re-assembles and re-images
(a few seconds), a cold build takes about half a minute besides the base tree.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import Settings
from ..guest import base as base_recipe
from ..guest import tools as recipe
from . import debian, elf, ext4, images
from ._fsutil import build_lock, scratch, staging, tree_size
from ._run import run
from .errors import ImageError

# Bump when the way the drive is assembled changes.
BUILDER_VERSION = 1
DRIVE = "tools.ext4"
MANIFEST = "tools.json"
_PY = f"python{base_recipe.GUEST_PYTHON}"

ProgressFn = Callable[[str], None]


@dataclass(frozen=True)
class ToolsDrive:
    digest: str
    path: Path  # the ext4 image, read-only
    size_bytes: int
    built_at: float = 0.0


def tools_root(settings: Settings) -> Path:
    return settings.artifacts / "tools"


def ensure_tools_drive(settings: Settings, progress: ProgressFn | None = None) -> ToolsDrive:
    """The tools drive of this aenv, building it (and the base Debian tree, if that is not
    cached yet) on a miss. Needs root and apt's lists on a miss; a hit reads two files."""
    say = progress or _quiet
    tree_key = images.base_tree_key()
    static = [debian.candidate(name) for name, _, _ in recipe.STATIC_TOOLS]
    runtime_key = _sha256_json({
        "builder": BUILDER_VERSION, "tree": tree_key,
        "static": [f"{p.name}={p.version}" for p in static],
        "recipe": recipe.recipe_digest(),
    })
    digest = _sha256_json({
        "runtime": runtime_key, "envd_site": images.envd_site_key(),
        "envd": base_recipe.guest_layer_digest(),
    })
    final = tools_root(settings) / digest
    if (final / MANIFEST).is_file():
        return read_manifest(final)
    if os.geteuid() != 0:
        raise ImageError("building the tools drive needs root (file ownership in it)")
    with build_lock(tools_root(settings)):
        if (final / MANIFEST).is_file():
            return read_manifest(final)
        debian_tree = images.base_debian_tree(settings, say)
        runtime = _runtime_tree(settings, runtime_key, debian_tree, static, say)
        site = images.envd_site(settings, say)
        with staging(final) as out, scratch(settings.cache_dir / "trees") as tree:
            say("assembling the tools drive")
            images.copy_tree(runtime, tree)
            _add_envd(tree, site, debian_tree)
            say("writing the tools drive")
            used = tree_size(tree)
            size = ext4.make_ext4(tree, out / DRIVE, size_bytes=_drive_size(used), seed=digest)
            os.chmod(out / DRIVE, 0o444)
            (out / MANIFEST).write_text(json.dumps({
                "digest": digest, "drive": DRIVE, "size_bytes": size, "used_bytes": used,
                "built_at": time.time(), "runtime": runtime_key,
            }, indent=2) + "\n")
    say(f"tools drive {digest[:12]} ready")
    return read_manifest(final)


def read_manifest(directory: Path) -> ToolsDrive:
    try:
        data = json.loads((directory / MANIFEST).read_text())
        drive = ToolsDrive(data["digest"], directory / data["drive"], int(data["size_bytes"]),
                           float(data.get("built_at", 0)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ImageError(f"bad tools drive manifest in {directory}: {e}") from None
    if not drive.path.is_file():
        raise ImageError(f"{drive.path} is missing")
    return drive


def _drive_size(used: int) -> int:
    """Room for the tree and ext4's metadata (inode tables, journal), rounded to 1 MiB."""
    want = used + used // 3 + 32 * ext4.MiB
    return -(-want // ext4.MiB) * ext4.MiB


def _sha256_json(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _quiet(_: str) -> None:
    pass


# -- the runtime part -------------------------------------------------------------------------


def _runtime_tree(settings: Settings, key: str, debian_tree: Path,
                  static: list[debian.Package], progress: ProgressFn) -> Path:
    final = settings.cache_dir / "tools-runtime" / key
    if (final / "lib" / _PY / "os.py").is_file():
        return final
    progress("building the tools runtime (python, its libraries, busybox, tini)")
    with staging(final) as tree:
        for d in ("bin", "lib", "python"):
            (tree / d).mkdir()
        _copy_file(debian_tree / "usr/bin" / _PY, tree / "bin" / _PY)
        _copy_file(debian_tree / "usr/bin/setpriv", tree / "bin/setpriv")
        _copy_stdlib(debian_tree / "usr/lib" / _PY, tree / "lib" / _PY)
        debs = debian.download(static, settings.cache_dir / "debs")
        with scratch(settings.cache_dir / "tmp") as tmp:
            for deb, (_, inside, dest) in zip(debs, recipe.STATIC_TOOLS, strict=True):
                debian.unpack(deb, tmp / deb.stem)
                _copy_file(tmp / deb.stem / inside, tree / dest)
        for applet in recipe.BUSYBOX_APPLETS:
            os.symlink("busybox", tree / "bin" / applet)
        dynload = sorted((tree / "lib" / _PY / "lib-dynload").glob("*.so"))
        _add_libraries(tree, debian_tree, [tree / "bin" / _PY, tree / "bin/setpriv", *dynload])
        loader = elf.find_library(debian_tree, "ld-linux-x86-64.so.2")
        if loader is None:
            raise ImageError(f"{debian_tree} has no ld-linux-x86-64.so.2")
        _copy_file(loader, tree / "lib/ld-linux-x86-64.so.2")
        progress("byte-compiling the standard library for the tools drive")
        _compile(tree, tree / "lib" / _PY)
        _own_by_root(tree)
    return final


def _copy_stdlib(src: Path, dest: Path) -> None:
    drop = {os.path.normpath(p) for p in recipe.STDLIB_DROP}

    def ignore(directory: str, names: list[str]) -> set[str]:
        rel = os.path.relpath(directory, src)
        out = {"__pycache__", "site-packages", "dist-packages"} & set(names)
        for name in names:
            if os.path.normpath(os.path.join(rel, name)) in drop:
                out.add(name)
        return out

    shutil.copytree(src, dest, symlinks=True, ignore=ignore)


def _add_libraries(tree: Path, debian_tree: Path, files: list[Path]) -> None:
    """Copy every library ``files`` need (from ``debian_tree``) into ``tree/lib``, under
    its soname; a library already there is kept."""
    for soname, path in elf.closure(debian_tree, files).items():
        dest = tree / "lib" / soname
        if not dest.exists():
            _copy_file(elf.real_path(debian_tree, path), dest)


def _copy_file(src: Path, dest: Path) -> None:
    if not src.is_file():
        raise ImageError(f"{src} is missing")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    mode = stat.S_IMODE(os.stat(src).st_mode)
    os.chmod(dest, 0o755 if mode & 0o111 else 0o644)


def _compile(tree: Path, *dirs: Path) -> None:
    """Byte-compile ``dirs`` with the drive's own interpreter (run from ``tree`` through its
    loader, as in a guest), recording the paths the guest sees."""
    argv = [os.fspath(tree / "lib/ld-linux-x86-64.so.2"), "--inhibit-cache", "--library-path",
            os.fspath(tree / "lib"), os.fspath(tree / "bin" / _PY), "-I", "-S",
            "-m", "compileall", "-q", "-j0", "-s", os.fspath(tree), "-p", recipe.PREFIX,
            *map(os.fspath, dirs)]
    run(argv, env={"PATH": "/usr/bin:/bin"})


def _own_by_root(tree: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), 0, 0)
    os.chown(tree, 0, 0)


# -- envd -------------------------------------------------------------------------------------


def _add_envd(tree: Path, site: Path, debian_tree: Path) -> None:
    """envd's dependencies and sources in ``python/``, the scripts in ``bin/``, the
    libraries of envd's compiled dependencies, all byte-compiled."""
    python = tree / recipe.PYTHON_DIR.removeprefix(recipe.PREFIX + "/")
    images.copy_tree(site, python)
    for host, guest in base_recipe.envd_sources():
        rel = guest.removeprefix(base_recipe.PYTHON_DIR + "/")
        dest = python / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(host.read_bytes())
        os.chmod(dest, 0o644)
    for f in recipe.scripts():
        dest = tree / f.path
        dest.unlink(missing_ok=True)
        dest.write_bytes(f.data)
        os.chmod(dest, f.mode)
    extensions = [p for p in python.rglob("*.so") if elf.is_elf(p)]
    _add_libraries(tree, debian_tree, extensions)
    _compile(tree, python)
    _own_by_root(tree)


# -- which disks boot with it -----------------------------------------------------------------

_QCOW2_MAGIC = b"QFI\xfb"
_MAX_CHAIN = 64


def disk_uses_tools(settings: Settings, path: Path) -> bool | None:
    """Whether a disk made from ``path`` boots with the tools drive: the answer of the image
    at the end of its chain (committed layers name their base in ``<id>.json``, qcow2
    files their backing file), or None when the chain ends at a file of no known image (a
    raw disk-only snapshot, which records no base): the boot then lets the guest decide."""
    for _ in range(_MAX_CHAIN):
        image = images.image_of_file(settings, path)
        if image is not None:
            return image.uses_tools
        parent = _layer_base(settings, path) or qcow2_backing(path)
        if parent is None:
            return None
        path = parent
    return None


def _layer_base(settings: Settings, path: Path) -> Path | None:
    """The ``base`` a committed disk layer's ``<id>.json`` records (``disk_layers.commit``)."""
    if path.parent.resolve() != settings.layers_dir.resolve():
        return None
    try:
        base = json.loads(path.with_suffix(".json").read_text()).get("base")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(base) if isinstance(base, str) and base else None


def qcow2_backing(path: Path) -> Path | None:
    """The backing file named in a qcow2 header (relative names are the file's
    directory's), or None for a raw file or a qcow2 without one."""
    try:
        with open(path, "rb") as f:
            header = f.read(20)
            if len(header) < 20 or header[:4] != _QCOW2_MAGIC:
                return None
            offset = int.from_bytes(header[8:16], "big")
            size = int.from_bytes(header[16:20], "big")
            if not offset or not size or size > 4096:
                return None
            f.seek(offset)
            name = f.read(size).decode()
    except (OSError, UnicodeDecodeError):
        return None
    backing = Path(name)
    return backing if backing.is_absolute() else path.parent / backing
