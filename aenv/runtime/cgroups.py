"""One cgroup per VMM process: the memory, CPU, task and I/O limits of one VM, enforced by
the kernel.

Contract: ``Hierarchies.discover()`` reads where this host mounts the ``memory``, ``cpu``,
``pids`` and ``io`` controllers (cgroup v2, or the v1 hierarchies of a legacy or hybrid
host, where v1 names ``io`` ``blkio``). ``create(vm_id, limits)`` makes the VM's cgroup
in each hierarchy that carries one of them and writes its limits; the caller puts the VMM
in it *before the VMM runs* (``procs_files``: the spawn wrapper of ``aenv.runtime.confine``
writes its own pid there and then execs the VMM, so no guest instruction and no allocation
of the VMM is ever charged elsewhere). ``VMCgroup.remove()`` after the VMM has exited;
``sweep`` removes what a crashed server left.

Where: under a parent named ``<prefix>-vms``.
- cgroup v2: ``<root>/<prefix>-vms/<vm_id>``, ``<root>`` the hierarchy's root as this
  process sees it (the cgroup namespace's root). v2's "no internal processes" rule forbids
  enabling controllers for children of a cgroup that holds processes, so the VM cgroups
  cannot live under the server's own cgroup when the server runs in it (a systemd service:
  ``/system.slice/aenv.service`` holds the server); the parent is a sibling tree created at
  the root instead, and this module enables the controllers in the root's
  ``cgroup.subtree_control`` (the root is exempt from the rule) and in the parent's. A
  systemd host keeps foreign top-level cgroups as they are. ``parent=`` (a path relative to
  the root) puts the tree elsewhere, e.g. into a subtree delegated to aenv
  (``Delegate=yes``) whose processes live in a leaf.
- cgroup v1 (no such rule): ``<own cgroup>/<prefix>-vms/<vm_id>`` in each hierarchy, so
  VMs stay inside whatever limits the server itself runs under.

The path of every cgroup made is recorded by the caller (the VM's manifest), so a server
that restarts elsewhere still finds and removes the cgroups of the VMs it re-attaches.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("aenv.runtime")

CONTROLLERS = ("memory", "cpu", "pids", "io")
_V1_NAMES = {"memory": "memory", "cpu": "cpu", "pids": "pids", "io": "blkio"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_REMOVE_TRIES = 50  # x 20 ms: an exited VMM leaves its cgroup within a few ms
MAX = "max"


class CgroupError(OSError):
    """A cgroup could not be found, made, written or removed; the message says which and
    what the host lacks."""


@dataclass(frozen=True)
class Limits:
    """The limits of one VM's cgroup. ``memory_max`` and ``swap_max`` in bytes;
    ``cpu_quota_us`` per ``cpu_period_us`` (None: no CPU cap); ``io_weight`` 1..10000
    (100 is the kernel's default; v1 maps it onto blkio's 10..1000)."""

    memory_max: int
    pids_max: int
    cpu_quota_us: int | None
    cpu_period_us: int = 100_000
    swap_max: int = 0
    io_weight: int = 100

    def __post_init__(self) -> None:
        if self.memory_max < (16 << 20) or self.pids_max < 8 or self.swap_max < 0:
            raise ValueError(f"implausible limits: {self}")
        if self.cpu_quota_us is not None and self.cpu_quota_us < 1000:
            raise ValueError("cpu quota below 1 ms per period")
        if not 1 <= self.io_weight <= 10000:
            raise ValueError("io weight must be in 1..10000")

    @property
    def cpu_max(self) -> str:
        """The v2 ``cpu.max`` line."""
        quota = MAX if self.cpu_quota_us is None else str(self.cpu_quota_us)
        return f"{quota} {self.cpu_period_us}"

    def as_dict(self) -> dict[str, int | None]:
        return {"memory_max": self.memory_max, "swap_max": self.swap_max,
                "pids_max": self.pids_max, "cpu_quota_us": self.cpu_quota_us,
                "cpu_period_us": self.cpu_period_us, "io_weight": self.io_weight}


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy carrying some of ``CONTROLLERS`` (``controllers`` in
    aenv's names). ``own`` is this process's cgroup in it, as a directory."""

    version: int
    mount: Path
    controllers: frozenset[str]
    own: Path

    def limit_files(self, limits: Limits) -> list[tuple[str, str]]:
        """(file, value) in the order they must be written; files the kernel does not
        offer (no swap accounting, no BFQ) are skipped by ``_write_limits``."""
        out: list[tuple[str, str]] = []
        c = self.controllers
        if self.version == 2:
            if "memory" in c:
                out += [("memory.max", str(limits.memory_max)),
                        ("memory.swap.max", str(limits.swap_max)),
                        ("memory.oom.group", "1")]
            if "cpu" in c:
                out.append(("cpu.max", limits.cpu_max))
            if "pids" in c:
                out.append(("pids.max", str(limits.pids_max)))
            if "io" in c:
                out += [("io.weight", f"default {limits.io_weight}"),
                        ("io.bfq.weight", str(limits.io_weight))]
            return out
        if "memory" in c:
            out.append(("memory.limit_in_bytes", str(limits.memory_max)))
            # memory+swap: only with swap accounting; equal to the limit = no swap.
            out.append(("memory.memsw.limit_in_bytes", str(limits.memory_max + limits.swap_max)))
        if "cpu" in c:
            out.append(("cpu.cfs_period_us", str(limits.cpu_period_us)))
            out.append(("cpu.cfs_quota_us", "-1" if limits.cpu_quota_us is None
                        else str(limits.cpu_quota_us)))
        if "pids" in c:
            out.append(("pids.max", str(limits.pids_max)))
        if "io" in c:
            v1_weight = str(max(10, min(1000, limits.io_weight)))
            out += [("blkio.weight", v1_weight), ("blkio.bfq.weight", v1_weight)]
        return out


@dataclass(frozen=True)
class VMCgroup:
    """The cgroup of one VM: one directory per hierarchy."""

    vm_id: str
    dirs: tuple[Path, ...]

    @property
    def procs_files(self) -> tuple[Path, ...]:
        return tuple(d / "cgroup.procs" for d in self.dirs)

    def pids(self) -> set[int]:
        """Every process in the cgroup (any hierarchy)."""
        found: set[int] = set()
        for f in self.procs_files:
            try:
                found.update(int(x) for x in f.read_text().split())
            except FileNotFoundError:
                continue
        return found

    def contains(self, pid: int) -> bool:
        return all(pid in _read_ints(f) for f in self.procs_files)

    def read(self, name: str) -> str | None:
        """An interface file of the cgroup (whichever hierarchy has it), or None."""
        for d in self.dirs:
            try:
                return (d / name).read_text().strip()
            except FileNotFoundError:
                continue
        return None

    def memory_stats(self) -> dict[str, int]:
        """``current``, ``peak`` (where the kernel tracks it), ``limit`` and ``oom_kills``,
        in bytes / counts, from whichever memory interface this host has."""
        out: dict[str, int] = {}
        if (cur := self.read("memory.current")) is not None:  # v2
            out["current"] = int(cur)
            out["limit"] = _int_or_max(self.read("memory.max") or MAX)
            if (peak := self.read("memory.peak")) is not None:
                out["peak"] = int(peak)
            events = _keyed(self.read("memory.events") or "")
            out["oom_kills"] = events.get("oom_kill", 0)
        elif (cur := self.read("memory.usage_in_bytes")) is not None:  # v1
            out["current"] = int(cur)
            out["limit"] = int(self.read("memory.limit_in_bytes") or 0)
            out["peak"] = int(self.read("memory.max_usage_in_bytes") or 0)
            out["oom_kills"] = _keyed(self.read("memory.oom_control") or "").get("oom_kill", 0)
        return out

    def kill(self) -> None:
        """SIGKILL every process in it (a leftover VMM nobody re-attached)."""
        for d in self.dirs:
            try:
                (d / "cgroup.kill").write_text("1")  # v2, 5.14+: atomic, also new forks
            except OSError:
                pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, *, wait: bool = True) -> bool:
        """Remove every directory; True when all are gone. With ``wait`` a cgroup whose
        processes are exiting is retried for up to a second."""
        gone = True
        for d in self.dirs:
            for attempt in range(_REMOVE_TRIES if wait else 1):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or attempt == _REMOVE_TRIES - 1 or not wait:
                        log.warning("cgroup %s not removed: %s", d, e.strerror,
                                    extra={"vm_id": self.vm_id})
                        gone = False
                        break
                    time.sleep(0.02)
        return gone

    def exists(self) -> bool:
        return any(d.is_dir() for d in self.dirs)


class Hierarchies:
    """The hierarchies this host offers for ``CONTROLLERS`` and where VM cgroups go in
    them (``parent_dirs``)."""

    def __init__(self, hierarchies: Iterable[Hierarchy], *, prefix: str,
                 parent: str | None = None) -> None:
        self.hierarchies = tuple(hierarchies)
        if not _NAME.fullmatch(prefix):
            raise ValueError(f"bad cgroup prefix {prefix!r}")
        if parent is not None and (parent.startswith("/") or ".." in parent.split("/")):
            raise ValueError(f"cgroup parent must be relative and without '..': {parent!r}")
        self.prefix = prefix
        self.parent = parent

    @classmethod
    def discover(cls, *, prefix: str, parent: str | None = None,
                 mountinfo: str = "/proc/self/mountinfo",
                 cgroup_file: str = "/proc/self/cgroup") -> Hierarchies:
        """What this process sees. v2 serves every controller it has enabled at its root;
        v1 hierarchies serve the rest (a hybrid host)."""
        try:
            mounts = Path(mountinfo).read_text().splitlines()
            own = _own_paths(Path(cgroup_file).read_text())
        except OSError as e:
            raise CgroupError(f"cannot read the cgroup mounts: {e}") from e
        v2: tuple[Path, str] | None = None
        v1: list[tuple[Path, str, set[str]]] = []
        for line in mounts:
            pre, _, post = line.partition(" - ")
            fields, post_fields = pre.split(), post.split()
            if len(fields) < 5 or len(post_fields) < 3:
                continue
            root, mount, fstype = fields[3], Path(_unescape(fields[4])), post_fields[0]
            if fstype == "cgroup2" and v2 is None:
                v2 = (mount, root)
            elif fstype == "cgroup":
                opts = set(post_fields[2].split(","))
                v1.append((mount, root, opts))
        found: list[Hierarchy] = []
        served: set[str] = set()
        if v2 is not None:
            mount, root = v2
            try:
                available = set((mount / "cgroup.controllers").read_text().split())
            except OSError:
                available = set()
            ours = frozenset(c for c in CONTROLLERS if c in available)
            if ours:
                found.append(Hierarchy(2, mount, ours, _own_dir(mount, root, own.get("", "/"))))
                served |= ours
        for mount, root, opts in v1:
            ours = frozenset(c for c in CONTROLLERS
                             if c not in served and _V1_NAMES[c] in opts)
            if not ours:
                continue
            path = next((p for names, p in own.items()
                         if names and set(names.split(",")) & opts), "/")
            found.append(Hierarchy(1, mount, ours, _own_dir(mount, root, path)))
            served |= ours
        return cls(found, prefix=prefix, parent=parent)

    @property
    def controllers(self) -> frozenset[str]:
        return frozenset().union(*(h.controllers for h in self.hierarchies))

    def parent_dir(self, h: Hierarchy) -> Path:
        name = f"{self.prefix}-vms"
        if self.parent is not None:
            return h.mount / self.parent / name
        return (h.mount if h.version == 2 else h.own) / name

    def parent_dirs(self) -> list[Path]:
        return [self.parent_dir(h) for h in self.hierarchies]

    def create(self, vm_id: str, limits: Limits) -> VMCgroup:
        """Make the VM's cgroup with ``limits`` written; a stale empty one of the same name
        is replaced. Raises ``CgroupError`` (nothing left behind) when a hierarchy refuses."""
        if not _NAME.fullmatch(vm_id) or vm_id.startswith("cgroup."):
            raise CgroupError(f"vm id {vm_id!r} cannot name a cgroup")
        made: list[Path] = []
        try:
            for h in self.hierarchies:
                parent = self.parent_dir(h)
                if h.version == 2:
                    _enable_down_to(h, parent)
                else:
                    parent.mkdir(parents=True, exist_ok=True)
                path = parent / vm_id
                try:
                    path.mkdir()
                except FileExistsError:
                    if _read_ints(path / "cgroup.procs"):
                        raise CgroupError(f"{path} exists and holds processes") from None
                    path.rmdir()
                    path.mkdir()
                made.append(path)
                _write_limits(path, h.limit_files(limits))
        except BaseException as e:
            VMCgroup(vm_id, tuple(made)).remove(wait=False)
            if isinstance(e, OSError) and not isinstance(e, CgroupError):
                raise CgroupError(f"cannot make the cgroup of {vm_id}: {e}") from e
            raise
        return VMCgroup(vm_id, tuple(made))

    def existing(self) -> Iterator[VMCgroup]:
        """The VM cgroups now under the parent (one per VM name, all hierarchies)."""
        names: dict[str, list[Path]] = {}
        for parent in self.parent_dirs():
            try:
                entries = list(os.scandir(parent))
            except FileNotFoundError:
                continue
            for e in entries:
                if e.is_dir(follow_symlinks=False) and _NAME.fullmatch(e.name):
                    names.setdefault(e.name, []).append(Path(e.path))
        for name, dirs in sorted(names.items()):
            yield VMCgroup(name, tuple(dirs))


def sweep(hierarchies: Hierarchies, keep: Iterable[str], owned: Callable[[int, str], bool],
          min_age_s: float = 60.0) -> tuple[list[str], list[str]]:
    """Remove the VM cgroups a crashed run left under the parent, except ``keep``. A cgroup
    with processes is killed and removed only when ``owned(pid, name)`` says each is ours
    (its VMM ran from our working directories); an empty one only once it is older than
    ``min_age_s`` (another server with the same prefix may be about to spawn into it).
    Returns (removed, left) names."""
    keep = set(keep)
    removed: list[str] = []
    left: list[str] = []
    now = time.time()
    for cg in hierarchies.existing():
        if cg.vm_id in keep:
            continue
        pids = cg.pids()
        if pids:
            if not all(owned(p, cg.vm_id) for p in pids):
                left.append(cg.vm_id)
                continue
            cg.kill()
        else:
            try:
                age = now - min(d.stat().st_mtime for d in cg.dirs)
            except OSError:
                continue
            if age < min_age_s:
                left.append(cg.vm_id)
                continue
        (removed if cg.remove() else left).append(cg.vm_id)
    return removed, left


# -- helpers ----------------------------------------------------------------------------------


def _enable_down_to(h: Hierarchy, parent: Path) -> None:
    """Create ``parent`` and enable our controllers in the subtree_control of every cgroup
    from the hierarchy's root down to it."""
    rel = parent.relative_to(h.mount)
    node = h.mount
    want = " ".join(f"+{c}" for c in sorted(h.controllers))
    for part in (None, *rel.parts):
        if part is not None:
            node = node / part
            node.mkdir(exist_ok=True)
        ctl = node / "cgroup.subtree_control"
        if set(h.controllers) <= set(ctl.read_text().split()):
            continue
        try:
            ctl.write_text(want)
        except OSError as e:
            hint = (" (cgroup v2 allows controllers for children only in a cgroup without "
                    "processes; give aenv a delegated subtree whose processes live in a leaf, "
                    "and name it as the cgroup parent)") if e.errno == errno.EBUSY else ""
            raise CgroupError(f"cannot enable {want} in {ctl}: {e.strerror}{hint}") from e


def _write_limits(path: Path, files: list[tuple[str, str]]) -> None:
    for name, value in files:
        f = path / name
        if not f.exists():
            continue  # the kernel does not offer it (no swap accounting, no BFQ, ...)
        try:
            f.write_text(value)
        except OSError as e:
            if name in ("memory.memsw.limit_in_bytes", "io.bfq.weight", "blkio.bfq.weight",
                        "blkio.weight", "io.weight", "memory.oom.group"):
                log.debug("cgroup %s: %s=%s not set: %s", path, name, value, e.strerror)
                continue
            raise CgroupError(f"cannot set {f} to {value}: {e.strerror}") from e


def _own_paths(text: str) -> dict[str, str]:
    """``/proc/self/cgroup``: controller list (v1, comma-joined; "" for v2) -> path."""
    own = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            own[parts[1]] = parts[2]
    return own


def _own_dir(mount: Path, root: str, path: str) -> Path:
    """The directory of cgroup ``path`` in a hierarchy mounted at ``mount`` whose mount
    root is ``root`` (usually "/")."""
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        path = path[len(root):]
    return mount / path.lstrip("/")


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _read_ints(path: Path) -> set[int]:
    try:
        return {int(x) for x in path.read_text().split()}
    except FileNotFoundError:
        return set()


def _keyed(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


def _int_or_max(value: str) -> int:
    return -1 if value == MAX else int(value)
