"""Guest kernels: what a VMM boots, prepared once per kernel version and cached.

Two flavors:

- ``cloud``: Debian bookworm's ``linux-image-*-cloud-amd64``, downloaded (not installed)
  into the cache. Its vmlinuz is unpacked to the ``vmlinux`` ELF (PVH boot, no in-guest
  decompression), and because virtio is modular there, an initramfs with busybox and the
  virtio modules mounts ``/dev/vda`` and switch_roots to the image's init. The module tree
  is kept too: images built for this kernel carry it in ``/lib/modules``.
- ``small``: compiled from Debian's ``linux-source-6.1`` with a minimal built-in config
  (``aenv kernel build small``, about 8 minutes on 2 cores); no initramfs, no modules.

Each kernel lives in ``Settings.kernels_dir/<flavor>-<version>/`` with a ``manifest.json``
naming its files; ``ensure_kernel`` returns the newest complete one of a flavor or builds it.
The manifest also records the recipe of the cloud initramfs (``initramfs_recipe``): a
kernel prepared by an older aenv gets its initramfs rewritten from the kept module tree the
next time it is asked for, so fixes to the initramfs reach existing installs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..config import Settings
from . import debian, vmlinux
from ._fsutil import build_lock, scratch, staging
from .cpio import CpioWriter
from .errors import KernelError, StorageError

FLAVORS = ("cloud", "small")
MANIFEST = "manifest.json"

# Loaded by the initramfs /init in this order (a module's dependencies are put before it
# when they are modular too). ext4 and its checksum are added only where they are modules.
INITRAMFS_MODULES = (
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_console",
    "virtio_rng",
    "ext4",
    "crc32c_generic",
)
_BUSYBOX_APPLETS = (
    "sh", "mount", "umount", "insmod", "switch_root", "usleep", "mkdir", "cat", "ip", "ln",
)

ProgressFn = Callable[[str], None]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernel:
    flavor: str  # "cloud" (Debian linux-image-*-cloud-amd64) or "small" (built)
    version: str  # e.g. "6.1.0-41-cloud-amd64": the guest's `uname -r`
    vmlinux: Path  # uncompressed ELF with PVH note: QEMU -M microvm -kernel and Firecracker
    initrd: Path | None  # initramfs (cloud: loads virtio modules, then switch_root)
    modules: Path | None = None  # /lib/modules/<version> tree for images (None: all built in)
    source: str = ""  # what it was made from, e.g. "linux-image-6.1.0-57-cloud-amd64 6.1.192-3"
    initrd_recipe: str = ""  # initramfs_recipe() the initrd was written with ("" if none)

    @property
    def directory(self) -> Path:
        return self.vmlinux.parent


def ensure_kernel(settings: Settings, flavor: str = "cloud", progress: ProgressFn | None = None
                  ) -> Kernel:
    """The newest prepared kernel of ``flavor``, preparing one first if there is none.

    Idempotent and cheap when cached: no network and no subprocess on a hit.
    """
    _check_flavor(flavor)
    found = [k for k in list_kernels(settings) if k.flavor == flavor]
    if not found:
        return build_kernel(settings, flavor, progress=progress)
    kernel = found[0]
    if kernel.initrd is not None and kernel.initrd_recipe != initramfs_recipe():
        kernel = _refresh_initrd(settings, kernel, progress or _quiet)
    return kernel


def build_kernel(settings: Settings, flavor: str = "cloud", *, progress: ProgressFn | None = None,
                 jobs: int | None = None) -> Kernel:
    """Prepare the current kernel of ``flavor`` (re-resolving the Debian version); a kernel
    already prepared for that version is returned as is."""
    _check_flavor(flavor)
    if flavor == "cloud":
        return _build_cloud(settings, progress or _quiet)
    from .kernel_small import build_small_kernel

    return build_small_kernel(settings, progress=progress or _quiet, jobs=jobs)


def list_kernels(settings: Settings) -> list[Kernel]:
    """Every complete kernel in ``kernels_dir``, newest first."""
    root = settings.kernels_dir
    if not root.is_dir():
        return []
    found: list[tuple[float, Kernel]] = []
    for d in root.iterdir():
        if d.name.startswith(".") or not (d / MANIFEST).is_file():
            continue
        try:
            found.append(read_manifest(d))
        except (KernelError, OSError):
            continue
    found.sort(key=lambda pair: pair[0], reverse=True)
    return [k for _, k in found]


def read_manifest(directory: Path) -> tuple[float, Kernel]:
    """(built-at time, kernel) recorded in ``directory/manifest.json``."""
    try:
        data = json.loads((directory / MANIFEST).read_text())
        kernel = Kernel(
            flavor=data["flavor"],
            version=data["version"],
            vmlinux=directory / data["vmlinux"],
            initrd=directory / data["initrd"] if data.get("initrd") else None,
            modules=directory / data["modules"] if data.get("modules") else None,
            source=data.get("source", ""),
            initrd_recipe=data.get("initrd_recipe", ""),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise KernelError(f"bad kernel manifest in {directory}: {e}") from None
    if not kernel.vmlinux.is_file():
        raise KernelError(f"{kernel.vmlinux} is missing")
    return float(data.get("built_at", 0)), kernel


def write_manifest(directory: Path, kernel_fields: dict[str, object]) -> None:
    _save_manifest(directory, {**kernel_fields, "built_at": time.time()})


def _save_manifest(directory: Path, data: dict[str, object]) -> None:
    _replace_file(directory / MANIFEST, (json.dumps(data, indent=2) + "\n").encode())


def _replace_file(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a new inode: hard links to the old one keep it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _check_flavor(flavor: str) -> None:
    if flavor not in FLAVORS:
        raise KernelError(f"unknown kernel flavor {flavor!r} (one of {', '.join(FLAVORS)})")


def _quiet(_: str) -> None:
    pass


# -- cloud ------------------------------------------------------------------------------------


def _build_cloud(settings: Settings, progress: ProgressFn) -> Kernel:
    progress("resolving linux-image-cloud-amd64")
    meta = debian.candidate("linux-image-cloud-amd64")
    image_name = next(
        (d for d in debian.depends_of(meta) if d.startswith("linux-image-")), None
    )
    if image_name is None:
        raise KernelError(f"linux-image-cloud-amd64 {meta.version} names no kernel package")
    image_pkg = debian.Package(image_name, meta.version)
    version = image_name.removeprefix("linux-image-")
    final = settings.kernels_dir / f"cloud-{version}"
    with build_lock(settings.kernels_dir):
        if (final / MANIFEST).is_file():
            return read_manifest(final)[1]
        debs = settings.cache_dir / "debs"
        progress(f"downloading {image_name} {meta.version}")
        (kernel_deb,) = debian.download([image_pkg], debs)
        with staging(final) as out:
            unpacked = out / ".unpack"
            progress(f"unpacking {kernel_deb.name}")
            debian.unpack(kernel_deb, unpacked)
            vmlinuz = unpacked / "boot" / f"vmlinuz-{version}"
            if not vmlinuz.is_file():
                raise KernelError(f"{kernel_deb.name} has no boot/vmlinuz-{version}")
            progress("extracting vmlinux from vmlinuz")
            (out / "vmlinux").write_bytes(vmlinux.extract(vmlinuz.read_bytes()))
            shutil.copy2(unpacked / "boot" / f"config-{version}", out / "config")
            os.makedirs(out / "modules", exist_ok=True)
            os.rename(unpacked / "lib" / "modules" / version, out / "modules" / version)
            shutil.rmtree(unpacked)
            progress("writing the initramfs")
            order = _write_initrd(settings, out / "initrd.img", out / "modules" / version)
            write_manifest(out, {
                "flavor": "cloud",
                "version": version,
                "vmlinux": "vmlinux",
                "initrd": "initrd.img",
                "modules": f"modules/{version}",
                "initrd_modules": order,
                "initrd_recipe": initramfs_recipe(),
                "source": f"{image_name} {meta.version}",
            })
    progress(f"kernel cloud {version} ready")
    return read_manifest(final)[1]


def _write_initrd(settings: Settings, path: Path, modules_root: Path) -> list[str]:
    """Write the cloud initramfs for the module tree at ``modules_root`` to ``path``; returns
    the module load order."""
    (busybox_deb,) = debian.download([debian.candidate("busybox-static")],
                                     settings.cache_dir / "debs")
    with scratch(settings.cache_dir) as tmp:
        debian.unpack(busybox_deb, tmp)
        busybox = (tmp / "bin" / "busybox").read_bytes()
    modules = ModuleTree(modules_root)
    order = modules.load_order(INITRAMFS_MODULES)
    _replace_file(path, initramfs(
        busybox=busybox, modules=[(name, modules.path(name).read_bytes()) for name in order]))
    return order


def _refresh_initrd(settings: Settings, kernel: Kernel, progress: ProgressFn) -> Kernel:
    """``kernel`` with its initramfs rewritten to the current recipe. Running VMs are not
    affected (the VMM read the old file at start, and a rename leaves it to them); when the
    rewrite fails (say busybox cannot be downloaded) the old initramfs, which still boots,
    is kept and the failure logged."""
    directory, recipe = kernel.directory, initramfs_recipe()
    with build_lock(settings.kernels_dir):
        data = json.loads((directory / MANIFEST).read_text())
        if data.get("initrd_recipe") == recipe:
            return read_manifest(directory)[1]
        if kernel.modules is None or kernel.initrd is None:
            return kernel
        progress(f"rewriting the initramfs of kernel {kernel.version} (aenv changed it)")
        try:
            order = _write_initrd(settings, kernel.initrd, kernel.modules)
        except (OSError, StorageError) as e:
            log.warning("kept the old initramfs of %s: %s", kernel.version, e)
            return kernel
        data.update(initrd_modules=order, initrd_recipe=recipe)
        _save_manifest(directory, data)  # keeps built_at: the kernel is no newer
    return read_manifest(directory)[1]


def initramfs_recipe() -> str:
    """sha256 over what the cloud initramfs is made of besides the kernel's own modules:
    its /init, the busybox applets it links and the module list."""
    h = hashlib.sha256()
    h.update(_initramfs_init())
    h.update(" ".join(_BUSYBOX_APPLETS).encode() + b"\n")
    h.update(" ".join(INITRAMFS_MODULES).encode())
    return h.hexdigest()


class ModuleTree:
    """The ``.ko`` files of one kernel's module tree, with dependencies read from each
    module's ``.modinfo`` (``depmod`` output is not shipped in the package)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[str, Path] = {}
        for path in (root / "kernel").rglob("*.ko"):
            self._paths[path.name[:-3].replace("-", "_")] = path
        builtin = root / "modules.builtin"
        self.builtin = {
            Path(line.strip()).name.removesuffix(".ko").replace("-", "_")
            for line in (builtin.read_text().splitlines() if builtin.is_file() else [])
        }

    def path(self, name: str) -> Path:
        try:
            return self._paths[name]
        except KeyError:
            raise KernelError(f"module {name} is not in {self.root}") from None

    def depends(self, name: str) -> list[str]:
        m = re.search(rb"(?:^|\0)depends=([^\0]*)", self.path(name).read_bytes())
        return [d.decode() for d in m.group(1).split(b",") if d] if m else []

    def load_order(self, wanted: Sequence[str]) -> list[str]:
        """``wanted`` minus built-ins, each preceded by its modular dependencies."""
        order: list[str] = []

        def visit(name: str, chain: tuple[str, ...]) -> None:
            if name in order or name in self.builtin:
                return
            if name in chain:
                raise KernelError(f"module dependency cycle: {' -> '.join((*chain, name))}")
            for dep in self.depends(name):
                visit(dep, (*chain, name))
            order.append(name)

        for name in wanted:
            visit(name, ())
        return order


def _initramfs_init() -> bytes:
    """The initramfs's /init (aenv/guest/files/initramfs-init.sh)."""
    return resources.files("aenv.guest").joinpath("files/initramfs-init.sh").read_bytes()


def initramfs(*, busybox: bytes, modules: Sequence[tuple[str, bytes]]) -> bytes:
    """A gzip newc initramfs: busybox, ``modules`` (name, .ko bytes) in load order, and
    aenv's ``/init`` (aenv/guest/files/initramfs-init.sh)."""
    init = _initramfs_init()
    cpio = CpioWriter()
    for d in ("bin", "dev", "etc", "lib", "lib/modules", "newroot", "proc", "sys"):
        cpio.directory(d)
    cpio.char_device("dev/console", 5, 1)
    cpio.file("bin/busybox", busybox, 0o755)
    for applet in _BUSYBOX_APPLETS:
        cpio.symlink(f"bin/{applet}", "busybox")
    for name, data in modules:
        cpio.file(f"lib/modules/{name}.ko", data)
    cpio.file("etc/aenv-modules", "".join(f"{name}\n" for name, _ in modules).encode())
    cpio.file("init", init, 0o755)
    return cpio.gzipped()
