"""Root-filesystem images: ext4 files built from a source tree, content-addressed, cached.

Sources: a directory, a rootfs tarball, an OCI image (layout directory, OCI archive or
``docker save`` archive; layers applied in order with whiteouts), or the ``base`` recipe
(Debian minbase by debootstrap plus Node.js from a pinned wheel, see ``aenv.guest.base``).
A build assembles a tree as root in the cache, optionally adds the guest layer (aenv's init
and envd, and for the cloud kernel its ``/lib/modules``), and writes
``images_dir/<digest>/rootfs.ext4`` with ``mkfs.ext4 -d``. The digest is the sha256 of
every input (name, source content, guest layer, kernel, size, builder version), so building
the same input again is a cache hit and any change to envd's code gives a new image. Images
are read-only once written: each VM gets its own copy-on-write disk over one.

Two ways a guest gets envd (``Image.boot``): ``guest-layer`` images carry it in the image
(``base`` does: the tree must be Debian-like with python3.11); ``tools`` images carry only
E2B's ``user`` (``guest_user``) and the ``/.aenv`` mountpoint, and boot with the shared tools
drive (``tools_drive``), so any tree, with any libc or none, becomes a guest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..config import Settings
from ..guest import base as recipe
from ..guest import tools as tools_recipe
from . import debian, disks, ext4, guest_user, oci, tar_layers
from ._fsutil import build_lock, scratch, staging
from ._run import run
from .errors import ImageError, StorageError
from .kernel import Kernel, ensure_kernel

# Bump when the way trees are assembled changes, so old cached images are not reused.
BUILDER_VERSION = 1
ROOTFS = "rootfs.ext4"
MANIFEST = "image.json"
BASE_NAME = "base"
# How an image's guest gets envd: from the image itself, or from the tools drive.
BOOT_GUEST_LAYER = "guest-layer"
BOOT_TOOLS = "tools"
# ``build_image``'s guest_layer: True (in the image), False (none: the tree as is) or
# "tools" (the tools drive's).
GuestLayer = bool | Literal["tools"]
# Directories a root needs for the boot (mountpoints, /tmp): made when a tools image lacks
# them, with their usual modes.
_ROOT_DIRS = (("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("run", 0o755),
              ("tmp", 0o1777), ("etc", 0o755), ("root", 0o700), ("home", 0o755))

ProgressFn = Callable[[str], None]


@dataclass(frozen=True)
class Image:
    name: str  # e.g. "base"
    digest: str  # content address (sha256 of the inputs/recipe)
    path: Path  # ext4 raw image, treated as read-only
    kernel_flavor: str  # which kernel it was built for (modules must match for cloud)
    size_bytes: int
    kernel_version: str = ""  # the cloud kernel whose modules it carries ("" if none)
    built_at: float = 0.0
    source: str = ""  # what it was built from, for people
    boot: str = BOOT_GUEST_LAYER  # BOOT_TOOLS: boots with the tools drive

    @property
    def uses_tools(self) -> bool:
        return self.boot == BOOT_TOOLS


def ensure_base_image(
    settings: Settings, progress: ProgressFn | None = None, *, kernel_flavor: str = "cloud",
    size_bytes: int | None = None,
) -> Image:
    """The ``base`` image for ``kernel_flavor``, building it on a miss (1.5 min cold on a
    busy 2-core machine: debootstrap dominates; its packages, the Node.js wheel and the
    finished Debian tree are cached for the next build)."""
    say = progress or _quiet
    kernel = ensure_kernel(settings, "cloud", progress=say) if kernel_flavor == "cloud" else None
    packages = list(recipe.BASE_PACKAGES)
    tree_key = _base_tree_key(packages)
    digest = _image_digest(
        BASE_NAME, {"kind": "debian-base", "tree": tree_key}, kernel_flavor, kernel, True,
        size_bytes,
    )

    def populate(tree: Path) -> None:
        base_tree = _debootstrap_tree(settings, tree_key, packages, say)
        say("copying the Debian tree")
        _copy_tree(base_tree, tree)

    return _build(
        settings, BASE_NAME, digest, populate, kernel_flavor=kernel_flavor, kernel=kernel,
        guest_layer=True, size_bytes=size_bytes,
        source=(f"debootstrap {debian.DEBIAN_SUITE} minbase + {len(packages)} packages"
                f" + node {recipe.NODE.version}"),
        progress=say,
    )


def build_image(
    settings: Settings,
    name: str,
    source: Path | oci.OciImage,
    *,
    kernel_flavor: str = "cloud",
    guest_layer: GuestLayer = True,
    size_bytes: int | None = None,
    progress: ProgressFn | None = None,
) -> Image:
    """An image named ``name`` from a directory, rootfs tarball or OCI/docker image (a path,
    or an ``OciImage`` already opened, as a registry pull gives one).

    ``guest_layer``: True puts aenv's guest layer into the image (the source must already
    hold Debian-like userland with python3.11, tini, iproute2 and useradd, as the base
    image does); ``"tools"`` makes any tree a guest that boots with the tools drive (only
    the user and the ``/.aenv`` mountpoint are added; the cloud kernel is required, whose
    initramfs mounts the drive); False images the tree as is.
    """
    say = progress or _quiet
    tools = guest_layer == "tools"
    if tools and kernel_flavor != "cloud":
        raise ImageError("images on the tools drive boot with the cloud kernel (its "
                         f"initramfs mounts the drive), not {kernel_flavor!r}")
    if isinstance(source, oci.OciImage):
        kind, source_digest, shown = "oci", source.digest, f"oci {source.digest}"
    else:
        source = source.resolve()
        if not source.exists():
            raise ImageError(f"image source {source} does not exist")
        kind, source_digest = _source_digest(source)
        shown = f"{kind} {source}"
    kernel = (
        ensure_kernel(settings, "cloud", progress=say)
        if guest_layer is True and kernel_flavor == "cloud" else None
    )
    digest = _image_digest(
        name, {"kind": kind, "source": source_digest}, kernel_flavor, kernel, guest_layer,
        size_bytes,
    )

    def populate(tree: Path) -> None:
        say(f"unpacking {shown}")
        if isinstance(source, oci.OciImage):
            _apply_oci(tree, source, say)
        elif kind == "dir":
            _copy_tree(source, tree)
        elif kind == "tar":
            tar_layers.apply_layer(tree, source)
        else:
            with oci.open_image(source, scratch=settings.cache_dir / "tmp") as image:
                _apply_oci(tree, image, say)

    return _build(
        settings, name, digest, populate, kernel_flavor=kernel_flavor, kernel=kernel,
        guest_layer=guest_layer, size_bytes=size_bytes, source=shown, progress=say,
    )


@dataclass(frozen=True)
class CopyLayer:
    """A template's COPY step laid into an image on the host instead of through a guest:
    ``entry`` (a directory, relative to the root of the uploaded ``archive``) is copied to
    the absolute guest path ``dest``, owned by root, modes as archived. ``key`` names the
    archive's content for the image's digest: its ``filesHash`` once checked against the
    archive (names, types, modes and contents, not mtimes: the CLI's archive of the same
    files differs in its bytes at every build), else "" for the archive file's sha256."""

    archive: Path
    entry: str
    dest: str
    key: str = ""


COPY_FAMILY = f"{BASE_NAME}+copy"  # base_image_with's images: <COPY_FAMILY>-<hash>


class NotLayerable(ImageError):
    """A COPY the host cannot lay as the guest would (its entry is no directory, or its
    destination exists in the base tree): the build runs it in the guest instead."""


def base_image_with(
    settings: Settings, layers: Sequence[CopyLayer], progress: ProgressFn | None = None, *,
    kernel_flavor: str = "cloud",
) -> Image:
    """The ``base`` image with ``layers`` laid into its tree, built on the host and cached
    by digest (the base recipe's, and every archive's content, entry and destination), so a
    template whose first steps COPY large directories boots with them in place. A cold
    build costs about what the base tree's copy and ``mkfs.ext4`` cost (seconds), against
    an upload through envd and an extraction under emulation (minutes for 100s of MB)."""
    say = progress or _quiet
    kernel = ensure_kernel(settings, "cloud", progress=say) if kernel_flavor == "cloud" else None
    packages = list(recipe.BASE_PACKAGES)
    tree_key = _base_tree_key(packages)
    parts = [{"archive": x.key or _file_digest(x.archive), "entry": x.entry, "dest": x.dest}
             for x in layers]
    name = f"{COPY_FAMILY}-{_sha256_json(parts)[:12]}"
    digest = _image_digest(
        name, {"kind": "debian-base-copy", "tree": tree_key, "layers": _sha256_json(parts)},
        kernel_flavor, kernel, True, None,
    )

    def populate(tree: Path) -> None:
        base_tree = _debootstrap_tree(settings, tree_key, packages, say)
        say("copying the Debian tree")
        _copy_tree(base_tree, tree)
        for layer in layers:
            _lay_copy(settings, tree, layer, say)

    return _build(
        settings, name, digest, populate, kernel_flavor=kernel_flavor, kernel=kernel,
        guest_layer=True, size_bytes=None,
        source=f"base + {len(layers)} COPY layer(s)", progress=say,
    )


def _lay_copy(settings: Settings, tree: Path, layer: CopyLayer, say: ProgressFn) -> None:
    if not layer.dest.startswith("/"):
        raise NotLayerable(f"COPY destination {layer.dest!r} is not absolute")
    target = Path(tar_layers.resolve(tree, layer.dest.rstrip("/") or "/"))
    if os.path.lexists(target):
        raise NotLayerable(f"COPY destination {layer.dest} exists in the base tree")
    say(f"laying {layer.entry} into {layer.dest}")
    with scratch(settings.cache_dir / "trees") as unpack:
        tar_layers.apply_layer(unpack, layer.archive)
        entry = Path(tar_layers.resolve(unpack, layer.entry, follow_last=False))
        if entry.is_symlink() or not entry.is_dir():
            raise NotLayerable(f"COPY source {layer.entry} is not a directory")
        for dirpath, dirnames, filenames in os.walk(entry):
            for n in (dirpath, *(os.path.join(dirpath, x) for x in dirnames + filenames)):
                os.lchown(n, 0, 0)
        # The directories made for the destination belong to root, as the guest's mkdir.
        target.parent.mkdir(parents=True, exist_ok=True)
        entry.rename(target)


def _apply_oci(tree: Path, image: oci.OciImage, say: ProgressFn) -> None:
    for i, layer in enumerate(image.layers, 1):
        say(f"applying layer {i}/{len(image.layers)}")
        tar_layers.apply_layer(tree, layer, whiteouts=True)


def image_by_digest(settings: Settings, digest: str) -> Image:
    """The image whose digest is exactly ``digest`` (an ``image:<digest>`` reference)."""
    if not digest or "/" in digest or digest.startswith("."):
        raise ImageError(f"bad image digest {digest!r}")
    directory = settings.images_dir / digest
    if not (directory / MANIFEST).is_file():
        raise ImageError(f"no image with digest {digest} in {settings.images_dir}")
    return _read_manifest(directory)


def image_of_file(settings: Settings, path: Path) -> Image | None:
    """The image whose root filesystem ``path`` is, or None when it is no image's."""
    try:
        path = path.resolve()
        if path.parent.parent != settings.images_dir.resolve():
            return None
        return _read_manifest(path.parent)
    except (OSError, ImageError):
        return None


def list_images(settings: Settings) -> list[Image]:
    """Every complete image, newest first."""
    root = settings.images_dir
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.name.startswith(".") or not (d / MANIFEST).is_file():
            continue
        try:
            found.append(_read_manifest(d))
        except ImageError:
            continue
    return sorted(found, key=lambda i: i.built_at, reverse=True)


def find_image(settings: Settings, name_or_digest: str) -> Image:
    """The newest image called ``name_or_digest``, or the one whose digest starts with it."""
    images = list_images(settings)
    for image in images:
        if image.name == name_or_digest:
            return image
    matches = [i for i in images if i.digest.startswith(name_or_digest)]
    if len(matches) == 1:
        return matches[0]
    raise ImageError(f"no image named {name_or_digest!r}")


def remove_image(settings: Settings, image: Image) -> None:
    """Delete ``image``. The caller must know that no disk or snapshot still uses it as a
    backing file (the orchestrator's store knows; this module does not)."""
    directory = image.path.parent
    if directory.parent != settings.images_dir:
        raise ImageError(f"{image.path} is not an image of {settings.images_dir}")
    with build_lock(settings.images_dir):
        shutil.rmtree(directory)


class UsersUnknown(ImageError):
    """What a snapshot, layer or disk reads from cannot be read: no image may be deleted."""


def image_users(settings: Settings, roots: Iterable[str] = ()) -> dict[str, list[str]]:
    """The images something on this node still reads, by digest, each with what reads it.

    Readers are found on disk, not only in records, so that a disk made a moment ago counts:
    every snapshot directory (``snapshots_dir``: templates, paused sandboxes, persistent
    snapshots, fork captures; complete or being written), every committed layer
    (``layers_dir``) and every VM's working directory (``vms_dir``: running sandboxes'
    disks and build VMs), through each qcow2 file's backing chain and each snapshot
    manifest's drive roots. ``roots`` are the store's references (``TemplateRecord.image``,
    a sandbox's ``snapshot_id``/``restored_from``); an ``image:<digest>`` among them names
    an image directly, as a template made from one does before its first snapshot.
    Raises ``UsersUnknown`` when a reader's dependencies cannot be read (fail closed)."""
    from . import snapshots
    from .image_ref import BadImageRef, ImageRef

    users: dict[str, list[str]] = {}

    def use(path: Path, by: str) -> None:
        image = image_of_file(settings, path)
        if image is not None and by not in users.setdefault(image.digest, []):
            users[image.digest].append(by)

    for r in roots:
        try:
            ref = ImageRef.parse(r)
        except BadImageRef:
            continue
        if ref.is_image:
            users.setdefault(ref.id, []).append(f"a record naming image:{ref.id[:12]}")

    def chain(path: Path, by: str) -> None:
        seen: set[Path] = set()
        current: Path | None = path
        while current is not None and current not in seen and current.exists():
            seen.add(current)
            use(current, by)
            try:
                info = snapshots.qcow2_info(current)
                if info is None and current.suffix == ".qcow2":
                    info = snapshots.image_info(current)  # a backing only QEMU resolves
            except (StorageError, ValueError, KeyError) as e:
                raise UsersUnknown(f"cannot read what {current} reads from: {e}") from e
            current = info.backing if info is not None else None

    places = ((settings.snapshots_dir, "snapshot"), (settings.layers_dir, "layer"),
              (settings.vms_dir, "vm"))
    for root, kind in places:
        if not root.is_dir():
            continue
        for entry in sorted(root.iterdir()):
            if entry.name == disks.OVERLAY_CACHE:
                continue  # empty overlays, made again on demand (disks.prune_overlay_cache)
            by = f"{kind} {entry.name}"
            if entry.is_dir():
                manifest = entry / snapshots.MANIFEST
                if manifest.is_file():
                    try:
                        for d in snapshots.read_manifest(entry).drives:
                            for p in (d.path, d.root, *d.chain):
                                if p is not None:
                                    use(p, by)
                    except StorageError as e:
                        raise UsersUnknown(f"{entry}: {e}") from e
                for f in sorted(entry.rglob("*")):
                    if f.is_file() and f.suffix in (".qcow2", ".img", ".raw", ""):
                        chain(f, by)
            elif entry.is_file():
                chain(entry, by)
    return users


def superseded_images(settings: Settings, keep: int = 1) -> list[Image]:
    """Images older than the ``keep`` newest of the same name and kernel flavor (every
    change to envd builds a new base image; the old ones only take space). The bases with
    COPY steps laid in (``base_image_with``, named ``base+copy-<hash of the layers>``) are
    one family: each new set of files makes a new name, and an older one that no template
    still reads is a cache entry a build lays again in seconds."""
    seen: dict[tuple[str, str], int] = {}
    old = []
    for image in list_images(settings):
        family = COPY_FAMILY if image.name.startswith(COPY_FAMILY + "-") else image.name
        key = (family, image.kernel_flavor)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > keep:
            old.append(image)
    return old


# -- digests ----------------------------------------------------------------------------------


def _sha256_json(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _image_digest(
    name: str, source: dict[str, str], kernel_flavor: str, kernel: Kernel | None,
    guest_layer: GuestLayer, size_bytes: int | None,
) -> str:
    inputs: dict[str, object] = {
        "builder": BUILDER_VERSION,
        "name": name,
        "source": source,
        "kernel_flavor": kernel_flavor,
        "kernel_version": kernel.version if kernel and kernel.modules else "",
        "guest_layer": recipe.guest_layer_digest() if guest_layer is True else "",
        "envd_site": _envd_site_key() if guest_layer is True else "",
        "size": size_bytes or 0,
    }
    if guest_layer == "tools":
        # What a tools image adds does not change with envd: the same tree stays the same
        # image across aenv versions (envd comes from the drive).
        inputs["boot"] = {"tools": _TOOLS_IMAGE_VERSION, "user": recipe.USER,
                          "uid": recipe.USER_UID, "mountpoint": tools_recipe.PREFIX}
    return _sha256_json(inputs)


def base_tree_key() -> str:
    """The cache key of the base recipe's Debian tree (the tools drive is made from it)."""
    return _base_tree_key(list(recipe.BASE_PACKAGES))


def base_debian_tree(settings: Settings, progress: ProgressFn | None = None) -> Path:
    """The base recipe's cached Debian tree, made on a miss (read it, never write it)."""
    packages = list(recipe.BASE_PACKAGES)
    return _debootstrap_tree(settings, _base_tree_key(packages), packages, progress or _quiet)


def _base_tree_key(packages: Sequence[str]) -> str:
    """The cache key of the base recipe's Debian tree: everything that goes into it."""
    return _sha256_json({
        "suite": debian.DEBIAN_SUITE, "mirror": debian.DEBIAN_MIRROR, "include": list(packages),
        "node": dataclasses.asdict(recipe.NODE),
        "setup": recipe.BASE_SETUP_SCRIPT,
    })


def _source_digest(source: Path) -> tuple[str, str]:
    """(kind, digest) of an image source: "dir", "tar" or "oci"."""
    if source.is_dir():
        if oci.is_oci_layout(source):
            with oci.open_image(source) as image:
                return "oci", image.digest
        return "dir", _tree_digest(source)
    if oci.is_image_archive(source):
        return "oci", _file_digest(source)
    return "tar", _file_digest(source)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _tree_digest(root: Path) -> str:
    """sha256 over names, types, ownership, modes, link targets and file contents."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            h.update(f"{rel}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0{st.st_rdev}\0".encode())
            if os.path.islink(path):
                h.update(os.readlink(path).encode())
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
            h.update(b"\n")
    return h.hexdigest()


# -- building ---------------------------------------------------------------------------------


def _build(
    settings: Settings,
    name: str,
    digest: str,
    populate: Callable[[Path], None],
    *,
    kernel_flavor: str,
    kernel: Kernel | None,
    guest_layer: GuestLayer,
    size_bytes: int | None,
    source: str,
    progress: ProgressFn,
) -> Image:
    final = settings.images_dir / digest
    if (final / MANIFEST).is_file():
        return _read_manifest(final)
    _require_root()
    with build_lock(settings.images_dir):
        if (final / MANIFEST).is_file():
            return _read_manifest(final)
        with staging(final) as out, scratch(settings.cache_dir / "trees") as tree:
            populate(tree)
            extra: dict[str, object] = {"boot": BOOT_GUEST_LAYER}
            if guest_layer == "tools":
                extra["boot"] = BOOT_TOOLS
                extra["user"] = dataclasses.asdict(_prepare_tools_root(tree, progress))
            elif guest_layer:
                extra["envd_packages"] = _install_guest_layer(settings, tree, kernel, progress)
            progress("writing the ext4 image")
            size = ext4.make_ext4(tree, out / ROOTFS, size_bytes=size_bytes, seed=digest)
            os.chmod(out / ROOTFS, 0o444)
            (out / MANIFEST).write_text(json.dumps({
                "name": name,
                "digest": digest,
                "rootfs": ROOTFS,
                "kernel_flavor": kernel_flavor,
                "kernel_version": kernel.version if kernel and kernel.modules else "",
                "size_bytes": size,
                "built_at": time.time(),
                "source": source,
                **extra,
            }, indent=2) + "\n")
    progress(f"image {name} {digest[:12]} ready")
    return _read_manifest(final)


def _read_manifest(directory: Path) -> Image:
    try:
        data = json.loads((directory / MANIFEST).read_text())
        image = Image(
            name=data["name"],
            digest=data["digest"],
            path=directory / data["rootfs"],
            kernel_flavor=data["kernel_flavor"],
            size_bytes=int(data["size_bytes"]),
            kernel_version=data.get("kernel_version", ""),
            built_at=float(data.get("built_at", 0)),
            source=data.get("source", ""),
            boot=data.get("boot", BOOT_GUEST_LAYER),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ImageError(f"bad image manifest in {directory}: {e}") from None
    if not image.path.is_file():
        raise ImageError(f"{image.path} is missing")
    return image


def _require_root() -> None:
    if os.geteuid() != 0:
        raise ImageError("building images needs root: file ownership in the image comes "
                         "from the build tree, and debootstrap/chroot need it too")


def _quiet(_: str) -> None:
    pass


def copy_tree(src: Path, dst: Path) -> None:
    """Copy the contents of ``src`` into ``dst`` keeping everything (reflinks where possible)."""
    _copy_tree(src, dst)


def _copy_tree(src: Path, dst: Path) -> None:
    """Copy the contents of ``src`` into ``dst`` keeping everything (reflinks where possible)."""
    dst.mkdir(parents=True, exist_ok=True)
    run(["cp", "-a", "--reflink=auto", f"{src}/.", f"{dst}/"])


def _debootstrap_tree(
    settings: Settings, key: str, packages: Sequence[str], progress: ProgressFn
) -> Path:
    """The cached base tree for ``key``: on a miss, debootstrap's minbase with ``packages``,
    Node.js (``recipe.NODE``) and ``recipe.BASE_SETUP_SCRIPT``."""
    final = settings.cache_dir / "debootstrap" / key
    if (final / "etc" / "debian_version").is_file():
        return final
    wheel = _node_wheel(settings, progress)
    progress(f"debootstrap {debian.DEBIAN_SUITE} minbase (+{len(packages)} packages)")
    with staging(final) as tree:
        # dpkg fsyncs every file it unpacks; the tree is synced once before it is renamed
        # into place instead (debootstrap took 110 s with fsyncs, 46 s without, here).
        unsafe_io = tree / "etc/dpkg/dpkg.cfg.d/aenv-build-unsafe-io"
        unsafe_io.parent.mkdir(parents=True)
        unsafe_io.write_text("force-unsafe-io\n")
        debian.debootstrap(tree, include=packages, debs_cache=settings.cache_dir / "debs")
        unsafe_io.unlink()
        progress(f"adding node {recipe.NODE.version}")
        _install_node(tree, wheel, recipe.NODE)
        progress("configuring the base tree (docs, pip, /usr/local)")
        run(["chroot", tree, "/bin/sh", "-c", recipe.BASE_SETUP_SCRIPT],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"})
        run(["sync", "-f", tree])
    return final


def _node_wheel(settings: Settings, progress: ProgressFn) -> Path:
    """The pinned Node.js wheel, from the cache or downloaded with pip; its sha256 checked."""
    dist = recipe.NODE
    cache = settings.cache_dir / "wheels"
    stem = f"{dist.project.replace('-', '_')}-{dist.version}-"
    for path in sorted(cache.glob(stem + "*.whl")):
        if _file_digest(path) == dist.wheel_sha256:
            return path
    progress(f"pip download {dist.requirement}")
    platforms = [arg for p in _WHEEL_PLATFORMS for arg in ("--platform", p)]
    with scratch(settings.cache_dir / "tmp") as tmp:
        run([
            sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
            "--no-deps", "--only-binary=:all:", "--python-version", recipe.GUEST_PYTHON,
            *platforms, "--dest", tmp, dist.requirement,
        ], env={"PIP_CACHE_DIR": str(settings.cache_dir / "pip")})
        found = sorted(tmp.glob(stem + "*.whl"))
        if not found:
            raise ImageError(f"pip download {dist.requirement} left no wheel")
        digest = _file_digest(found[0])
        if digest != dist.wheel_sha256:
            raise ImageError(f"{found[0].name} has sha256 {digest}, the recipe pins "
                             f"{dist.wheel_sha256}")
        cache.mkdir(parents=True, exist_ok=True)
        os.replace(found[0], cache / found[0].name)
        return cache / found[0].name


def _install_node(tree: Path, wheel: Path, dist: recipe.NodeDist) -> None:
    """Unpack ``dist.keep`` of the wheel's upstream layout to ``dist.prefix`` in ``tree``
    (owned by root, modes from the wheel), strip ``dist.strip`` and add ``dist.links``."""
    prefix = Path(tar_layers.resolve(tree, dist.prefix.lstrip("/")))
    with zipfile.ZipFile(wheel) as whl:
        for info in whl.infolist():
            rel = info.filename.removeprefix(dist.root)
            if (rel == info.filename or info.is_dir()
                    or not any(rel == k or (k.endswith("/") and rel.startswith(k))
                               for k in dist.keep)):
                continue
            if ".." in Path(rel).parts or Path(rel).is_absolute():
                raise ImageError(f"{wheel.name}: unsafe path {info.filename!r}")
            target = prefix / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with whl.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(target, 0o755 if mode & 0o111 else 0o644)
    for rel in dist.strip:
        run(["strip", prefix / rel])
    for link, points_to in dist.links:
        path = prefix / link
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        os.symlink(points_to, path)
    for dirpath, dirnames, filenames in os.walk(prefix):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), 0, 0)


# -- tools images -----------------------------------------------------------------------------

# Bump when what a tools image adds to its tree changes.
_TOOLS_IMAGE_VERSION = 1


def _prepare_tools_root(tree: Path, progress: ProgressFn) -> guest_user.GuestUser:
    """What a tree needs to boot with the tools drive: the mountpoint (``/.aenv``, empty),
    the directories the init mounts over or a user writes to, and E2B's user."""
    progress(f"adding {recipe.USER} and the tools mountpoint")
    for name, mode in _ROOT_DIRS:
        path = Path(tar_layers.resolve(tree, name))
        if not os.path.lexists(path):
            path.mkdir(parents=True)
            os.chown(path, 0, 0)
            os.chmod(path, mode)
    mountpoint = Path(tar_layers.resolve(tree, tools_recipe.PREFIX.lstrip("/"),
                                         follow_last=False))
    if mountpoint.is_symlink() or (os.path.lexists(mountpoint) and not mountpoint.is_dir()):
        mountpoint.unlink()
    elif mountpoint.is_dir():
        shutil.rmtree(mountpoint)  # the image's own /.aenv would be hidden by the drive
    mountpoint.mkdir()
    os.chown(mountpoint, 0, 0)
    os.chmod(mountpoint, 0o755)
    return guest_user.add_user(tree, recipe.USER, uid=recipe.USER_UID)


# -- guest layer ------------------------------------------------------------------------------

_WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                    "linux_x86_64")
_PREREQUISITES = ("usr/bin/python3", "usr/bin/tini", "bin/sh", "usr/sbin/useradd")


def _install_guest_layer(
    settings: Settings, tree: Path, kernel: Kernel | None, progress: ProgressFn
) -> list[str]:
    """Add init, envd and (cloud) kernel modules to ``tree``; returns envd's packages."""
    missing = [p for p in _PREREQUISITES if not os.path.lexists(tar_layers.resolve(tree, p))]
    if not os.path.isdir(tar_layers.resolve(tree, f"usr/lib/python{recipe.GUEST_PYTHON}")):
        missing.append(f"python{recipe.GUEST_PYTHON}")
    if missing:
        raise ImageError(f"the source lacks what aenv's guest layer needs: {', '.join(missing)}")
    progress("installing envd and its dependencies")
    site = _envd_site(settings, progress)
    python_dir = Path(tar_layers.resolve(tree, recipe.PYTHON_DIR.lstrip("/")))
    python_dir.parent.mkdir(parents=True, exist_ok=True)
    _copy_tree(site, python_dir)
    for host, guest in recipe.envd_sources():
        _write(tree, guest, host.read_bytes(), 0o644)
    for f in recipe.guest_files():
        _write(tree, f.path, f.data, f.mode)
    if kernel is not None and kernel.modules is not None:
        progress(f"adding modules of {kernel.version}")
        modules = Path(tar_layers.resolve(tree, "lib/modules")) / kernel.version
        shutil.rmtree(modules, ignore_errors=True)
        modules.parent.mkdir(parents=True, exist_ok=True)
        _copy_tree(kernel.modules, modules)
    progress("configuring the guest (user, sudo, byte-compiling)")
    run(["chroot", tree, "/bin/sh", "-c", recipe.SETUP_SCRIPT],
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"})
    return sorted(_installed_dists(site))


def _write(tree: Path, guest_path: str, data: bytes, mode: int) -> None:
    path = Path(tar_layers.resolve(tree, guest_path.lstrip("/"), follow_last=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.write_bytes(data)
    os.chown(path, 0, 0)
    os.chmod(path, mode)


def _host_constraints() -> list[str]:
    """``name==version`` of every distribution in the running environment: the guest gets
    the versions the host's tests ran with, wherever a package is in both."""
    from importlib import metadata

    pins = set()
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and dist.version and name.lower() != "aenv":
            pins.add(f"{name}=={dist.version}")
    return sorted(pins)


def envd_site_key() -> str:
    """The cache key of envd's dependencies installed for the guest's Python."""
    return _envd_site_key()


def envd_site(settings: Settings, progress: ProgressFn | None = None) -> Path:
    """envd's dependencies installed for the guest's Python (cached; read, never write)."""
    return _envd_site(settings, progress or _quiet)


def _envd_site_key() -> str:
    return _sha256_json({
        "requirements": recipe.envd_requirements(),
        "constraints": _relevant_constraints(),
        "python": recipe.GUEST_PYTHON,
        "platforms": _WHEEL_PLATFORMS,
    })


def _relevant_constraints() -> list[str]:
    names = {_req_name(r) for r in recipe.envd_requirements()}
    return [c for c in _host_constraints() if _req_name(c) in names]


def _req_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def _envd_site(settings: Settings, progress: ProgressFn) -> Path:
    """envd's dependencies installed for the guest's Python (cached by requirement set)."""
    final = settings.cache_dir / "envd-site" / _envd_site_key()
    done = final.with_name(final.name + ".complete")
    if done.is_file() and final.is_dir():
        return final
    progress("pip install envd's dependencies for the guest")
    with staging(final) as target:
        constraints = target / ".constraints.txt"
        constraints.write_text("\n".join(_host_constraints()) + "\n")
        platforms = [arg for p in _WHEEL_PLATFORMS for arg in ("--platform", p)]
        run([
            sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
            "--no-compile", "--no-warn-script-location", "--target", target,
            "--only-binary=:all:", "--python-version", recipe.GUEST_PYTHON,
            "--implementation", "cp", "--abi", "cp" + recipe.GUEST_PYTHON.replace(".", ""),
            *platforms, "-c", constraints, *recipe.envd_requirements(),
        ], env={"PIP_CACHE_DIR": str(settings.cache_dir / "pip")})
        constraints.unlink()
        # Console scripts name the host's interpreter; envd starts from its own launcher.
        shutil.rmtree(target / "bin", ignore_errors=True)
    done.write_text("")
    return final


def _installed_dists(site: Path) -> list[str]:
    out = []
    for info in site.glob("*.dist-info"):
        stem = info.name.removesuffix(".dist-info")
        name, _, version = stem.rpartition("-")
        out.append(f"{name}=={version}")
    return out
