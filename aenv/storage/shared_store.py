"""The cluster's shared snapshot store (``AENV_SHARED_STORE``): a directory every node
mounts (NFS, CephFS, EFS; a local directory in tests) where snapshots are *published*
atomically and content-addressed, and from which a node *fetches* (verified) into its local
store a snapshot it does not have.

Layout under the store's root::

    blobs/sha256/<digest>        one file's bytes (sparse where the source was)
    bundles/sha256/<digest>      a bundle: JSON naming every file a snapshot needs
    refs/<snapshot id>           the digest of that snapshot's bundle

A snapshot is rarely self-contained: its manifest names memory layers and drive files of
other snapshots and the template layer or image its drives end on, by absolute path
(``aenv.storage.snapshots``). Its bundle is its closure (``snapshot_store.reachable``):
every file of every snapshot directory and template layer it reaches, each by its path
relative to the node's snapshots or layers root, with its digest and size. The images a
closure ends on (a drive's root, or the end of a template layer's backing chain) that a
build laid on the host (``fromImage`` pulls, COPY steps laid into a copy of the base:
``image:<digest>`` under ``AENV_CACHE_HOME/images``) are published too, once per image
(``images/<digest>.json`` lists its files' blobs): a node that lacks one fetches it to its
own images directory (``LocalRoots.images``; None: the publisher's path) and the layers
and manifests that name it are pointed there. Other files outside those roots (guest
kernels, the ``base`` image, the tools drive, which every node builds from the same recipe)
are not copied: the bundle lists them as ``external`` and a node that lacks one cannot
restore the snapshot.

Writes: each blob and bundle is copied to a temporary name unique to the writer, fsynced,
renamed into place and its directory fsynced; the ref is written the same way, last. A
reader that finds a ref finds everything it names. Blobs already present are not copied
again (same digest, same bytes). Copies run in the kernel (``snapshots.copy_sparse``:
``SEEK_DATA``/``sendfile``, holes stay holes); hashing reads the data once, in hashlib.

Fetch: every file is copied into a partial directory next to its destination, hashed
there, and refused (``SharedStoreError``, nothing installed) when its digest differs from
the bundle's; then the paths the manifests and qcow2 headers record are rewritten from the
publishing node's roots to this node's, and each directory is renamed into place.
Directories already complete locally are kept as they are (snapshot ids are unique).

**Portability**: a bundle carries ``requires`` (``portability``): the runtime driver, its
accelerator, the host CPU model, the guest kernel, the machine record's version and the
aenv version that wrote it. ``incompatibilities`` compares it with what a node offers
(``node_capabilities``) and says, in words, why the node cannot restore it.

**Collection**: a node's collection never touches the shared store (it deletes only what
its own roots no longer reach in its local snapshot and layer directories; a fetched
snapshot is local like any other). The shared store is append-only in this slice: a
published snapshot stays until an operator removes its ref (``unpublish``) and then
unreferenced blobs (``collect``, which keeps every blob any remaining bundle names). The
rule: a blob is deleted only when no ref's bundle names it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from . import durable, snapshot_store, snapshots
from .errors import StorageError

BLOBS = Path("blobs/sha256")
BUNDLES = Path("bundles/sha256")
REFS = Path("refs")
IMAGES = Path("images")
IMAGE_MANIFEST = "image.json"   # aenv.storage.images.MANIFEST: what marks an image's dir
BASE_IMAGE = "base"             # aenv.storage.images.BASE_NAME: every node builds its own
BUNDLE_FORMAT = "aenv-snapshot-bundle"
BUNDLE_VERSION = 1
_CHUNK = 1 << 20
_ZEROS = bytes(_CHUNK)


class SharedStoreError(StorageError):
    """The shared store cannot publish or hand over a snapshot (missing, corrupt)."""


class NotPublished(SharedStoreError):
    """No snapshot of that id was published."""


class Incompatible(SharedStoreError):
    """This node cannot restore the snapshot; ``reasons`` says why."""

    def __init__(self, snapshot_id: str, reasons: list[str]) -> None:
        self.reasons = reasons
        super().__init__(f"snapshot {snapshot_id} cannot be restored on this node: "
                         + "; ".join(reasons))


# -- portability ------------------------------------------------------------------------


def cpu_model() -> str:
    """The host CPU's model name (what a restored guest's CPUID was taken from)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def portability(manifest: snapshots.Manifest) -> dict[str, Any]:
    """What restoring a VM snapshot needs, from its manifest and this host."""
    vm = manifest.vm
    return {"driver": manifest.driver, "accel": vm.get("accel"),
            "cpu_model": cpu_model() if vm.get("accel") == "kvm" else None,
            "kernel": Path(str(vm["kernel"])).parent.name if vm.get("kernel") else None,
            "machine_version": vm.get("version"), "aenv": __version__}


def node_capabilities(driver: str, accel: str, kernels: Iterable[str]) -> dict[str, Any]:
    """What a node offers, in ``portability``'s terms (``kernels``: the kernel builds it
    has, by directory name)."""
    return {"driver": driver, "accel": accel, "cpu_model": cpu_model(),
            "kernels": sorted(kernels), "aenv": __version__}


def incompatibilities(requires: dict[str, Any], offers: dict[str, Any]) -> list[str]:
    """Why a node offering ``offers`` cannot restore a snapshot that ``requires`` (empty:
    it can). A guest captured under KVM saw the host's CPU: it restores only on the same
    CPU model; a TCG guest's CPU is emulated, so any host runs it."""
    out: list[str] = []
    if requires.get("driver") and requires["driver"] != offers.get("driver"):
        out.append(f"it was taken by the {requires['driver']} driver, this node runs "
                   f"{offers.get('driver')}")
    if requires.get("accel") and requires["accel"] != offers.get("accel"):
        out.append(f"it needs the {requires['accel']} accelerator, this node has "
                   f"{offers.get('accel')}")
    if requires.get("cpu_model") and requires["cpu_model"] != offers.get("cpu_model"):
        out.append(f"it was taken on a '{requires['cpu_model']}' CPU, this node has "
                   f"'{offers.get('cpu_model')}'")
    if requires.get("kernel") and requires["kernel"] not in offers.get("kernels", ()):
        out.append(f"it runs guest kernel {requires['kernel']}, which this node lacks")
    if requires.get("aenv") and requires["aenv"] != offers.get("aenv"):
        out.append(f"it was written by aenv {requires['aenv']}, this node runs "
                   f"{offers.get('aenv')}")
    return out


# -- digests and copies -------------------------------------------------------------------


def digest(path: Path) -> str:
    """sha256 of the file's bytes (holes read as zeros, fed without reading them)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        offset = 0
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                start = size
            _zeros(h, start - offset)
            if start >= size:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            pos = start
            while pos < end:
                n = os.preadv(fd, [view[:min(_CHUNK, end - pos)]], pos)
                if n == 0:
                    raise SharedStoreError(f"{path} shrank while being hashed")
                h.update(view[:n])
                pos += n
            offset = end
    return h.hexdigest()


def _zeros(h: Any, n: int) -> None:
    while n > 0:
        step = min(n, _CHUNK)
        h.update(_ZEROS[:step])
        n -= step


def _temp_beside(path: Path) -> Path:
    """A unique temporary name in ``path``'s directory (unique across the nodes sharing
    the store: host, pid and random)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.{socket.gethostname()}.{os.getpid()}.",
                                dir=path.parent)
    os.close(fd)
    os.unlink(name)
    return Path(name)


def _install(src: Path, dest: Path) -> None:
    """Copy ``src`` to ``dest`` atomically and durably (kernel copy, fsync, rename)."""
    tmp = _temp_beside(dest)
    try:
        snapshots.copy_sparse(src, tmp)
        durable.fsync_file(tmp)
        os.replace(tmp, dest)
        durable.fsync_dir(dest.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write(dest: Path, data: bytes) -> None:
    tmp = _temp_beside(dest)
    try:
        durable.write_atomic(tmp, data)
        os.replace(tmp, dest)
        durable.fsync_dir(dest.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# -- the store ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BundleFile:
    path: str      # "snapshots/<id>/<file>" or "layers/<file>"
    digest: str
    size: int
    mode: int = 0o644


@dataclass(frozen=True)
class Bundle:
    snapshot_id: str
    files: tuple[BundleFile, ...]
    roots: dict[str, str]                      # the publisher's snapshots/layers roots
    requires: dict[str, Any] = field(default_factory=dict)
    external: tuple[str, ...] = ()             # absolute paths outside those roots
    images: dict[str, str] = field(default_factory=dict)  # published image -> its dir there

    def to_json(self) -> bytes:
        return json.dumps({
            "format": BUNDLE_FORMAT, "version": BUNDLE_VERSION,
            "snapshot": self.snapshot_id, "roots": self.roots, "requires": self.requires,
            "external": list(self.external), "images": self.images,
            "files": [{"path": f.path, "digest": f.digest, "size": f.size, "mode": f.mode}
                      for f in self.files]}, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Bundle:
        try:
            data = json.loads(raw)
            if data.get("format") != BUNDLE_FORMAT or data.get("version") != BUNDLE_VERSION:
                raise SharedStoreError(f"{where}: not a version {BUNDLE_VERSION} bundle")
            return cls(str(data["snapshot"]),
                       tuple(BundleFile(str(f["path"]), str(f["digest"]), int(f["size"]),
                                        int(f.get("mode", 0o644))) for f in data["files"]),
                       {k: str(v) for k, v in data["roots"].items()},
                       dict(data.get("requires") or {}),
                       tuple(str(p) for p in data.get("external", ())),
                       {str(k): str(v) for k, v in (data.get("images") or {}).items()})
        except (ValueError, KeyError, TypeError) as e:
            raise SharedStoreError(f"{where}: malformed bundle ({e})") from e


@dataclass(frozen=True)
class LocalRoots:
    """A node's local snapshot and template-layer directories, and where images fetched
    from the store go (None: where the publisher had them)."""

    snapshots: Path
    layers: Path
    images: Path | None = None


class SharedStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._chains: dict[Path, list[Path]] = {}  # layer -> its backing chain (immutable)

    def _ref(self, snapshot_id: str) -> Path:
        if not snapshot_id or "/" in snapshot_id or snapshot_id.startswith("."):
            raise SharedStoreError(f"bad snapshot id {snapshot_id!r}")
        return self.root / REFS / snapshot_id

    def has(self, snapshot_id: str) -> bool:
        return self._ref(snapshot_id).is_file()

    def bundle(self, snapshot_id: str) -> Bundle:
        ref = self._ref(snapshot_id)
        try:
            bundle_digest = ref.read_text().strip()
        except FileNotFoundError:
            raise NotPublished(f"snapshot {snapshot_id} is not in the shared store") from None
        path = self.root / BUNDLES / bundle_digest
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise SharedStoreError(f"{ref} names bundle {bundle_digest}, which is missing") \
                from None
        if hashlib.sha256(raw).hexdigest() != bundle_digest:
            raise SharedStoreError(f"bundle {bundle_digest} of {snapshot_id} is corrupt")
        return Bundle.from_json(raw, str(path))

    def ids(self) -> list[str]:
        d = self.root / REFS
        return sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) \
            if d.is_dir() else []

    # -- publish

    def publish(self, local: LocalRoots, snapshot_id: str,
                requires: dict[str, Any] | None = None) -> Bundle:
        """Publish ``snapshot_id`` from ``local`` with its whole closure; returns its
        bundle. Idempotent: blobs already there are not copied again."""
        directory = local.snapshots / snapshot_id
        if not snapshot_store.is_complete(directory):
            raise SharedStoreError(f"snapshot {snapshot_id} is not complete on this node")
        if requires is None:
            requires = {"aenv": __version__}
            if snapshot_store.disk_snapshot(directory) is None:
                requires = portability(snapshots.read_manifest(directory))
        keep = snapshot_store.reachable(local.snapshots, local.layers,
                                        [snapshot_store.ref(snapshot_id)])
        files: list[BundleFile] = []
        roots = {"snapshots": str(local.snapshots), "layers": str(local.layers)}
        for item in sorted(keep):
            if not item.exists():
                continue
            kind = "snapshots" if item.parent == local.snapshots else "layers"
            if kind == "snapshots" and item.name != snapshot_id and \
                    (known := self._published_here(item.name, roots)) is not None:
                files.extend(known)  # a snapshot never changes: not hashed again
                continue
            members = sorted(p for p in item.rglob("*") if p.is_file()) if item.is_dir() \
                else [item, *_layer_sidecars(item)]
            base = local.snapshots if kind == "snapshots" else local.layers
            for f in members:
                if any(part.startswith(".") for part in f.relative_to(base).parts):
                    continue
                d = digest(f)
                blob = self.root / BLOBS / d
                if not blob.exists():
                    _install(f, blob)
                st = f.stat()
                files.append(BundleFile(f"{kind}/{f.relative_to(base)}", d, st.st_size,
                                        st.st_mode & 0o777))
        external = _external(local, keep) | self._layer_backings(local, keep)
        images = {d.name: str(d) for d in map(_host_image, sorted(external)) if d}
        for d in images.values():
            self._publish_image(Path(d))
        published = {Path(d) for d in images.values()}
        external = {p for p in external if Path(p).parent not in published}
        bundle = Bundle(snapshot_id, tuple(files), roots, requires, tuple(sorted(external)),
                        images)
        raw = bundle.to_json()
        bundle_digest = hashlib.sha256(raw).hexdigest()
        dest = self.root / BUNDLES / bundle_digest
        if not dest.exists():
            _write(dest, raw)
        _write(self._ref(snapshot_id), bundle_digest.encode())
        return bundle

    def _layer_backings(self, local: LocalRoots, keep: set[Path]) -> set[str]:
        """What the closure's template layers are backed by outside the local roots (the
        image a build's first layer sits on)."""
        out: set[str] = set()
        for item in keep:
            if item.parent != local.layers or item.suffix != ".qcow2":
                continue
            if item not in self._chains:
                self._chains[item] = snapshot_store.backing_chain(item)
            out.update(str(p) for p in self._chains[item] if not _under(p, local))
        return out

    def _image_record(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise SharedStoreError(f"bad image digest {name!r}")
        return self.root / IMAGES / f"{name}.json"

    def _publish_image(self, directory: Path) -> None:
        """Publish a host-laid image's files, once: an image never changes (its directory
        is named by the digest of its inputs)."""
        record = self._image_record(directory.name)
        if record.is_file():
            return
        files = []
        for f in sorted(p for p in directory.iterdir()
                        if p.is_file() and not p.name.startswith(".")):
            d = digest(f)
            blob = self.root / BLOBS / d
            if not blob.exists():
                _install(f, blob)
            st = f.stat()
            files.append({"name": f.name, "digest": d, "size": st.st_size,
                          "mode": st.st_mode & 0o777})
        _write(record, json.dumps({"image": directory.name, "files": files},
                                  indent=1).encode())

    def _fetch_image(self, name: str, directory: Path) -> None:
        """Install published image ``name`` as ``directory``, verified, unless there."""
        if (directory / IMAGE_MANIFEST).is_file():
            return
        record = self._image_record(name)
        try:
            files = json.loads(record.read_bytes())["files"]
        except (OSError, ValueError, KeyError) as e:
            raise SharedStoreError(f"image {name} is not in the shared store: {e}") from e
        staging = _temp_beside(directory)
        try:
            for f in files:
                self._copy_verified(BundleFile(f"images/{name}/{f['name']}", str(f["digest"]),
                                               int(f["size"]), int(f.get("mode", 0o644))),
                                    staging / str(f["name"]))
            durable.fsync_tree(staging)
            try:
                durable.rename_durably(staging, directory)
            except OSError:
                if not (directory / IMAGE_MANIFEST).is_file():
                    raise
                shutil.rmtree(staging, ignore_errors=True)  # another fetch was first
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _published_here(self, snapshot_id: str, roots: dict[str, str]
                        ) -> list[BundleFile] | None:
        """The files of snapshot directory ``snapshot_id`` as its own bundle lists them,
        when this node published it from the same roots (a fetched copy's manifest and
        qcow2 headers were rewritten: its bytes are not the publisher's)."""
        try:
            bundle = self.bundle(snapshot_id)
        except SharedStoreError:
            return None
        if bundle.roots != roots:
            return None
        prefix = f"snapshots/{snapshot_id}/"
        own = [f for f in bundle.files if f.path.startswith(prefix)]
        if not all((self.root / BLOBS / f.digest).is_file() for f in own):
            return None
        # A background compaction (``aenv.runtime.compaction``) replaces a drive file and
        # then the manifest after the publication: the old file reads through a chain the
        # new closure no longer carries. The manifests (a few KiB) tell.
        local = Path(roots["snapshots"]) / snapshot_id
        for f in own:
            if f.path.endswith(".json") and not _same_digest(local / f.path[len(prefix):],
                                                             f.digest):
                return None
        return own or None

    def unpublish(self, snapshot_id: str) -> None:
        self._ref(snapshot_id).unlink(missing_ok=True)

    def collect(self) -> list[Path]:
        """Delete bundles and blobs no ref names (see the module's rule)."""
        live_bundles: set[str] = set()
        live_blobs: set[str] = set()
        for sid in self.ids():
            try:
                b = self.bundle(sid)
            except SharedStoreError:
                return []  # fail closed: an unreadable bundle may name anything
            live_bundles.add((self.root / REFS / sid).read_text().strip())
            live_blobs.update(f.digest for f in b.files)
        removed: list[Path] = []
        for folder, live in ((BUNDLES, live_bundles), (BLOBS, live_blobs)):
            d = self.root / folder
            if d.is_dir():
                for p in d.iterdir():
                    if not p.name.startswith(".") and p.name not in live:
                        p.unlink(missing_ok=True)
                        removed.append(p)
        return removed

    # -- fetch

    def fetch(self, local: LocalRoots, snapshot_id: str,
              offers: dict[str, Any] | None = None) -> Bundle:
        """Install ``snapshot_id`` and its closure into ``local``, verified; raises
        ``Incompatible`` (before copying anything) when ``offers`` cannot restore it."""
        bundle = self.bundle(snapshot_id)
        if offers is not None and (why := incompatibilities(bundle.requires, offers)):
            raise Incompatible(snapshot_id, why)
        missing = [p for p in bundle.external if not Path(p).exists()]
        if missing:
            raise Incompatible(snapshot_id, [f"this node lacks {', '.join(missing)}"])
        old = {k: Path(v) for k, v in bundle.roots.items()}
        images: list[tuple[Path, Path]] = []
        for name, there in sorted(bundle.images.items()):
            here = local.images / name if local.images is not None else Path(there)
            self._fetch_image(name, here)
            if here != Path(there):
                images.append((Path(there), here))
        moves = _Moves(old["snapshots"], local.snapshots, old["layers"], local.layers,
                       tuple(images))
        groups: dict[str, list[BundleFile]] = {}
        for f in bundle.files:
            kind, _, rest = f.path.partition("/")
            if kind == "snapshots":
                groups.setdefault(f"snapshots/{rest.split('/', 1)[0]}", []).append(f)
            elif kind == "layers":
                groups.setdefault(f"layers/{Path(rest).stem}", []).append(f)
            else:
                raise SharedStoreError(f"bundle of {snapshot_id} names {f.path}")
        # Dependencies first: the snapshot itself (its ref makes it usable) last.
        order = sorted(groups, key=lambda g: g == f"snapshots/{snapshot_id}")
        for group in order:
            kind, _, name = group.partition("/")
            if kind == "snapshots":
                self._fetch_snapshot(local.snapshots / name, groups[group], moves)
            else:
                self._fetch_layer(local.layers, groups[group], moves)
        return bundle

    def _copy_verified(self, f: BundleFile, dest: Path) -> None:
        blob = self.root / BLOBS / f.digest
        if not blob.is_file():
            raise SharedStoreError(f"blob {f.digest} ({f.path}) is missing from the store")
        dest.parent.mkdir(parents=True, exist_ok=True)
        snapshots.copy_sparse(blob, dest)
        if dest.stat().st_size != f.size or digest(dest) != f.digest:
            raise SharedStoreError(f"{f.path}: the shared store's copy does not match its "
                                   f"digest {f.digest}")
        os.chmod(dest, f.mode)

    def _fetch_snapshot(self, directory: Path, files: list[BundleFile], moves: _Moves
                        ) -> None:
        if snapshot_store.is_complete(directory):
            return
        staging = snapshots.begin(directory)
        try:
            for f in files:
                rel = Path(f.path).relative_to(Path("snapshots") / directory.name)
                self._copy_verified(f, staging / rel)
            moves.rewrite_snapshot(staging)
            durable.fsync_tree(staging)
            durable.rename_durably(staging, directory)
        except BaseException:
            snapshots.abort(staging)
            raise

    def _fetch_layer(self, layers: Path, files: list[BundleFile], moves: _Moves) -> None:
        targets = [layers / Path(f.path).relative_to("layers") for f in files]
        if all(t.exists() for t in targets):
            return
        staged: list[tuple[Path, Path]] = []
        try:
            for f, t in zip(files, targets, strict=True):
                tmp = _temp_beside(t)
                staged.append((tmp, t))
                self._copy_verified(f, tmp)
                if t.suffix == ".qcow2":
                    moves.rebase(tmp)
                durable.fsync_file(tmp)
            # the image before its sidecar (.json): a layer is known by its sidecar
            for tmp, t in sorted(staged, key=lambda s: s[1].suffix == ".json"):
                os.replace(tmp, t)
            durable.fsync_dir(layers)
        except BaseException:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)
            raise


def _same_digest(path: Path, expected: str) -> bool:
    try:
        return digest(path) == expected
    except OSError:
        return False


def _layer_sidecars(layer: Path) -> list[Path]:
    side = layer.with_suffix(".json")
    return [side] if side != layer and side.is_file() else []


def _external(local: LocalRoots, keep: set[Path]) -> set[str]:
    """Files the closure reads outside the local roots (kernels, images)."""
    out: set[str] = set()
    for item in keep:
        if item.is_dir() and (item / snapshots.MANIFEST).is_file():
            m = snapshots.read_manifest(item)
            for key in ("kernel", "initrd"):
                if m.vm.get(key):
                    out.add(str(m.vm[key]))
            for d in m.drives:
                for p in (d.root, d.path):
                    if p is not None and not _under(p, local):
                        out.add(str(p))
    return out


def _host_image(path: str) -> Path | None:
    """The directory of the host-laid image ``path`` is the root filesystem of (an aenv
    image other than ``base``), else None."""
    d = Path(path).parent
    try:
        name = json.loads((d / IMAGE_MANIFEST).read_bytes()).get("name")
    except (OSError, ValueError, AttributeError):
        return None
    return d if isinstance(name, str) and name != BASE_IMAGE else None


def _under(p: Path, local: LocalRoots) -> bool:
    return p.is_relative_to(local.snapshots) or p.is_relative_to(local.layers)


@dataclass(frozen=True)
class _Moves:
    """Rewrites paths from the publisher's roots to this node's."""

    old_snapshots: Path
    new_snapshots: Path
    old_layers: Path
    new_layers: Path
    images: tuple[tuple[Path, Path], ...] = ()  # an image's directory there -> here

    @property
    def pairs(self) -> tuple[tuple[Path, Path], ...]:
        return ((self.old_snapshots, self.new_snapshots), (self.old_layers, self.new_layers),
                *self.images)

    @property
    def moved(self) -> bool:
        return any(old != new for old, new in self.pairs)

    def path(self, p: str) -> str:
        q = Path(p)
        for old, new in self.pairs:
            if q.is_relative_to(old):
                return str(new / q.relative_to(old))
        return p

    def _walk(self, value: Any) -> Any:
        if isinstance(value, str) and value.startswith("/"):
            return self.path(value)
        if isinstance(value, list):
            return [self._walk(v) for v in value]
        if isinstance(value, dict):
            return {k: self._walk(v) for k, v in value.items()}
        return value

    def rewrite_snapshot(self, staging: Path) -> None:
        manifest = staging / snapshots.MANIFEST
        if manifest.is_file() and self.moved:
            data = json.loads(manifest.read_text())
            data = self._walk(data)
            durable.write_atomic(manifest, json.dumps(data, indent=1).encode())
        for image in staging.glob("*.qcow2"):
            self.rebase(image)

    def rebase(self, image: Path) -> None:
        """Point a qcow2's backing file at this node's copy (header only: ``-u``)."""
        if not self.moved:
            return
        info = snapshots.image_info(image)
        if info.backing is None:
            return
        moved = self.path(str(info.backing))
        if moved != str(info.backing):
            subprocess.run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-b", moved,
                            "-F", info.backing_format or "qcow2", str(image)],
                           check=True, capture_output=True)

