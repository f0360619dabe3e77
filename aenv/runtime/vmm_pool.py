"""Pre-started VMMs: a create from a template takes a VMM that already runs and only loads
the device state into it.

A restore spends most of its host-side time before the guest's state matters: the working
directory and drive overlays, the confinement, the VMM's exec and start-up, the QMP
handshake (~25-35 ms on this 2-core TCG host). None of it depends on the sandbox, only on
the template's snapshot and a network slot: ``VMMPool`` runs it ahead of demand
(``prestart`` of the driver) inside warm network slots and keeps the VMMs waiting, the
snapshot's memory mapped copy-on-write and its drives open. A create takes one, has the
slot's egress policy set and calls the driver's ``activate`` (device state, vCPUs on: a
few ms).

Sizing: per template snapshot ("shape": vCPUs and memory come with the snapshot), as many
as were taken in the last ``window_s`` seconds, at least one while the snapshot was taken
from in the last ``idle_s`` seconds, at most ``size``; all pooled VMMs together never hold
more than ``memory_mb`` of guest memory (a pooled VMM is charged its guest's size, which
is what it holds once a create takes it; while it waits it holds QEMU's own few MiB). The
filler works one VMM at a time and only while no start is under way (``busy``) — between
bursts — or once a refill has waited ``max_defer_s``.

A snapshot restored only once — a paused sandbox's, for its resume — can be asked for
with ``want_once``: one VMM, made only with the memory the templates' targets leave free,
kept until taken or until its time is up.

A pooled VMM that died is discarded when found (the create falls back to an ordinary
restore), and logged with how it ended (exit status or signal, how long after it was
made) and the tail of its log (``workdir.VMM_LOG``: QEMU's stderr), read before its
working directory goes; pooled VMMs of a snapshot that is gone (template deleted and
collected) are discarded by ``prune``; ``close`` ends them all and gives their slots
back. A server that crashed leaves them running: ``sweep`` kills the VMM of every pool
working directory (``PREFIX``) before the node removes leftover directories and slots.

VMM-neutral: the driver implements ``Prestarting`` (the QEMU driver does; the Firecracker
one would with a process whose API socket is up, then ``PUT /snapshot/load``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from ..storage import snapshots as snap
from . import workdir as wd
from .base import VM, RestoreOverrides, VMError
from .vmm_process import NotOurProcessError, VMMProcess

log = logging.getLogger("aenv.runtime")

PREFIX = "vp"  # working directories of pooled VMMs: <vms_dir>/vp<hex>
_RETRY_AFTER_FAILURE_S = 2.0
_CLOSE_WAIT_S = 30.0  # close waits this long for the filler's step under way
_WAIT_FOR_MAKING_S = 2.0  # a one-shot take waits this long for its VMM being made
_DEATH_LOG_LINES = 10  # lines of a dead pooled VMM's log that are logged


class _Unwanted(VMError):
    """A VMM was made for a one-shot snapshot that no longer wants it (discarded)."""


class PrestartedVMM(Protocol):
    """What a driver's ``prestart`` returns."""

    @property
    def vm_id(self) -> str: ...

    @property
    def workdir(self) -> Path: ...

    def is_alive(self) -> bool: ...

    @property
    def returncode(self) -> int | None:
        """The VMM's exit status once it has exited (negative: killed by that signal);
        None while it runs or when unknown."""
        ...


P = TypeVar("P", bound=PrestartedVMM)


class Prestarting(Protocol[P]):
    """A driver whose restore splits into ``prestart`` (ahead of demand) and ``activate``."""

    async def prestart(self, snapshot_dir: Path, overrides: RestoreOverrides) -> P: ...

    async def activate(self, pre: P) -> VM: ...

    async def discard(self, pre: P) -> None: ...


class Lease(Protocol):
    """A network slot as the pool needs it: the namespace the VMM is started in."""

    @property
    def netns(self) -> str: ...


S = TypeVar("S", bound=Lease)


@dataclass
class Pooled(Generic[S]):
    """One waiting VMM: its snapshot (``key``), the slot it runs in, its guest size."""

    key: Path
    pre: Any  # the driver's PrestartedVMM
    slot: S
    memory_mib: int
    made_at: float = field(default_factory=time.monotonic)

    @property
    def workdir(self) -> Path:
        return Path(self.pre.workdir)


def snapshot_key(snapshot_dir: Path) -> Path:
    return snapshot_dir.resolve()


class VMMPool(Generic[S]):
    """Pre-started VMMs per template snapshot; see the module docstring. Use from one event
    loop: ``start``, ``take``, ``give_back``/``discard``, ``prune``, ``close``."""

    def __init__(self, runtime: Prestarting[Any], vms_dir: Path, *, size: int,
                 memory_mb: int, acquire: Callable[[], Awaitable[S]],
                 release: Callable[[S], Awaitable[None]], busy: Callable[[], bool],
                 window_s: float = 60.0, idle_s: float = 600.0,
                 max_defer_s: float = 2.0) -> None:
        if size < 0 or memory_mb < 0:
            raise ValueError("size and memory_mb must be >= 0")
        self.runtime = runtime
        self.vms_dir = vms_dir
        self.size = size
        self.memory_mb = memory_mb
        self._acquire, self._release, self._busy = acquire, release, busy
        self.window_s, self.idle_s, self.max_defer_s = window_s, idle_s, max_defer_s
        self._idle: dict[Path, collections.deque[Pooled[S]]] = {}
        self._takes: dict[Path, collections.deque[float]] = {}  # monotonic times of asks
        self._making: dict[Path, int] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._failed_at: dict[Path, float] = {}
        # Snapshots restored at most once (a paused sandbox's), wanted until a deadline: one
        # VMM each, made only with memory the templates' targets leave free.
        self._once: dict[Path, float] = {}
        self.stats = {"hits": 0, "misses": 0, "made": 0, "discarded": 0, "dead": 0}

    # -- life -------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.size > 0 and self.memory_mb > 0

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.create_task(self._fill_loop(), name="aenv-vmm-pool")

    async def close(self) -> None:
        """Stop filling, end every pooled VMM and give its slot back."""
        self._closed = True
        self._wake.set()
        if self._task is not None:
            # Let the filler finish what it is doing (a VMM being made or discarded):
            # cancelled half way, it could leave a process, directory or slot behind.
            try:
                await asyncio.wait_for(asyncio.shield(self._task), _CLOSE_WAIT_S)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        entries = [e for q in self._idle.values() for e in q]
        self._idle.clear()
        for entry in entries:
            await self.discard(entry)

    @staticmethod
    def sweep(vms_dir: Path, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Kill the VMMs that a crashed server left waiting in pool working directories
        (blocking), except those named in ``keep`` (taken by a sandbox before the crash:
        to be re-attached). Their directories, cgroups and slots are then leftovers like
        any other. Returns the directories whose VMM was killed."""
        killed = []
        for d in vms_dir.glob(f"{PREFIX}*") if vms_dir.is_dir() else ():
            if d.name in keep:
                continue
            try:
                pid = int((d / wd.PIDFILE).read_text().strip())
                process = VMMProcess.adopt(pid, d)
            except (OSError, ValueError, NotOurProcessError):
                continue
            process.kill_now()
            killed.append(d.name)
        return killed

    # -- taking -----------------------------------------------------------------------------

    def note(self, snapshot_dir: Path) -> None:
        """Count one ask for ``snapshot_dir`` (a create from it), hit or miss."""
        key = snapshot_key(snapshot_dir)
        self._takes.setdefault(key, collections.deque()).append(time.monotonic())
        self._wake.set()

    def want_once(self, snapshot_dir: Path, for_s: float) -> None:
        """Pre-start one VMM of a snapshot that will be restored once (a paused sandbox's,
        for its resume), if memory allows, and keep it for ``for_s`` seconds at most."""
        if self.enabled and not self._closed:
            self._once[snapshot_key(snapshot_dir)] = time.monotonic() + for_s
            self._wake.set()

    async def take(self, snapshot_dir: Path, *, once: bool = False) -> Pooled[S] | None:
        """A live pooled VMM of ``snapshot_dir``, or None (then restore as usual). Dead
        ones met on the way are discarded. A template's ask counts as demand either way;
        ``once``: the snapshot is restored this once (``want_once``), no demand."""
        if not self.enabled or self._closed:
            return None
        key = snapshot_key(snapshot_dir)
        if once:
            # Its VMM may be half made (the restore came soon after the pause): finishing
            # it is sooner than starting another.
            deadline = time.monotonic() + _WAIT_FOR_MAKING_S
            while self._making.get(key) and not self._idle.get(key) and \
                    time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            self._once.pop(key, None)
        else:
            self.note(key)
        queue = self._idle.get(key)
        while queue:
            entry = queue.popleft()
            if entry.pre.is_alive():
                self.stats["hits"] += 1
                return entry
            self.stats["dead"] += 1
            _log_death(entry)
            await self.discard(entry)
        self.stats["misses"] += 1
        return None

    async def discard(self, entry: Pooled[S]) -> None:
        """End a pooled VMM (taken or not) and free its working directory and slot."""
        self.stats["discarded"] += 1
        try:
            await self.runtime.discard(entry.pre)
        except (VMError, OSError):
            log.exception("pooled VMM %s: discard failed", entry.pre.vm_id)
        await asyncio.to_thread(wd.remove, entry.workdir)
        try:
            await self._release(entry.slot)
        except Exception:
            log.exception("pooled VMM %s: its slot was not released", entry.pre.vm_id)
        self._wake.set()

    async def prune(self) -> int:
        """Discard the pooled VMMs whose snapshot is gone (its template deleted and its
        files collected) or dead; forget the demand for a gone snapshot."""
        n = 0
        for key in list(self._idle):
            gone = not (key / snap.MANIFEST).is_file()
            queue = self._idle[key]
            keep: collections.deque[Pooled[S]] = collections.deque()
            while queue:
                entry = queue.popleft()
                if gone or not entry.pre.is_alive():
                    if not entry.pre.is_alive():
                        self.stats["dead"] += 1
                        _log_death(entry)
                    await self.discard(entry)
                    n += 1
                else:
                    keep.append(entry)
            self._idle[key] = keep
            if gone:
                self._idle.pop(key, None)
                self._takes.pop(key, None)
        for key in [k for k in self._takes if not (k / snap.MANIFEST).is_file()]:
            self._takes.pop(key, None)
        return n + await self._expire_once()

    async def _expire_once(self) -> int:
        """Discard the VMMs of one-shot snapshots whose time is up or whose files are gone."""
        now, n = time.monotonic(), 0
        for key, until in list(self._once.items()):
            if until > now and (key / snap.MANIFEST).is_file():
                continue
            del self._once[key]
            if key in self._takes:
                continue  # also a template's: its VMMs stay
            for entry in self._idle.pop(key, ()):
                await self.discard(entry)
                n += 1
        return n

    # -- sizing -----------------------------------------------------------------------------

    def held_mb(self) -> int:
        """Guest memory the pool holds now (waiting VMMs and those being made)."""
        return sum(e.memory_mib for q in self._idle.values() for e in q) + sum(
            n * _memory_mib(k) for k, n in self._making.items())

    def idle(self, snapshot_dir: Path | None = None) -> int:
        if snapshot_dir is not None:
            return len(self._idle.get(snapshot_key(snapshot_dir), ()))
        return sum(len(q) for q in self._idle.values())

    def target(self, key: Path, now: float | None = None) -> int:
        """How many VMMs of ``key`` the pool aims to hold: the asks of the last
        ``window_s`` seconds, at least one after an ask in the last ``idle_s``, at most
        ``size``."""
        now = time.monotonic() if now is None else now
        asks = self._takes.get(key)
        if not asks:
            return 0
        while asks and asks[0] < now - max(self.window_s, self.idle_s):
            asks.popleft()
        if not asks:
            return 0
        recent = sum(1 for t in asks if t >= now - self.window_s)
        return min(self.size, max(1, recent))

    def _next_to_make(self) -> Path | None:
        """The template snapshot furthest below its target that fits the memory budget;
        else a one-shot snapshot without its VMM, if the templates' shortfall leaves the
        memory for it."""
        now = time.monotonic()
        best: tuple[int, Path] | None = None
        shortfall_mb = 0
        for key in list(self._takes):
            if now - self._failed_at.get(key, -1e9) < _RETRY_AFTER_FAILURE_S:
                continue
            have = len(self._idle.get(key, ())) + self._making.get(key, 0)
            short = self.target(key, now) - have
            if short <= 0 or not (key / snap.MANIFEST).is_file():
                continue
            shortfall_mb += short * _memory_mib(key)
            if self.held_mb() + _memory_mib(key) > self.memory_mb:
                continue
            if best is None or short > best[0]:
                best = (short, key)
        if best is not None:
            return best[1]
        for key, until in self._once.items():
            if until <= now or self._idle.get(key) or self._making.get(key):
                continue
            if now - self._failed_at.get(key, -1e9) < _RETRY_AFTER_FAILURE_S:
                continue
            if self.held_mb() + shortfall_mb + _memory_mib(key) <= self.memory_mb:
                return key
        return None

    # -- filling ----------------------------------------------------------------------------

    async def _fill_loop(self) -> None:
        deferred_since: float | None = None
        while not self._closed:
            if self._once:
                await self._expire_once()
            key = self._next_to_make()
            if key is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                deferred_since = None
                continue
            now = time.monotonic()
            if self._busy():
                deferred_since = deferred_since or now
                if now - deferred_since < self.max_defer_s:
                    await asyncio.sleep(0.02)
                    continue
            deferred_since = None
            try:
                await self.fill_one(key)
            except asyncio.CancelledError:
                raise
            except _Unwanted as e:
                log.info("%s", e)
            except Exception as e:
                self._failed_at[key] = time.monotonic()
                log.warning("pre-starting a VMM of %s failed: %s", key, e)

    async def fill_one(self, key: Path) -> Pooled[S]:
        """Pre-start one VMM of snapshot ``key`` in a slot of its own and pool it."""
        key = snapshot_key(key)
        memory_mib = _memory_mib(key)
        one_shot = key in self._once and key not in self._takes
        self._making[key] = self._making.get(key, 0) + 1
        try:
            slot = await self._acquire()
            vm_id = f"{PREFIX}{secrets.token_hex(6)}"
            workdir = self.vms_dir / vm_id
            try:
                pre = await self.runtime.prestart(key, RestoreOverrides(
                    vm_id=vm_id, workdir=workdir, netns=slot.netns))
            except BaseException:
                await asyncio.to_thread(wd.remove, workdir)
                await self._release(slot)
                raise
        finally:
            self._making[key] -= 1
            if not self._making[key]:
                del self._making[key]
        entry: Pooled[S] = Pooled(key, pre, slot, memory_mib)
        if self._closed:
            await self.discard(entry)
            raise VMError("the VMM pool was closed while a VMM was being pre-started")
        if one_shot and key not in self._once and key not in self._takes:
            # A one-shot snapshot whose restore came (or whose time ran out) meanwhile.
            await self.discard(entry)
            raise _Unwanted(f"{key.name} was no longer wanted when its VMM was ready")
        self._idle.setdefault(key, collections.deque()).append(entry)
        self.stats["made"] += 1
        log.info("pre-started VMM %s of %s (%d waiting)", vm_id, key.name,
                 len(self._idle[key]))
        return entry


def exit_description(code: int | None) -> str:
    """An exit status as words: ``exit status 1``, ``killed by SIGKILL``."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _log_death(entry: Pooled[Any]) -> None:
    """Log a pooled VMM found dead: how it ended, when, and its log's tail (its working
    directory, log included, is removed by the discard that follows)."""
    tail = wd.tail(entry.workdir / wd.VMM_LOG, lines=_DEATH_LOG_LINES).strip()
    log.warning("pooled VMM %s of %s had exited (%s, %.0f ms after it was pre-started); "
                "discarded; its log ends: %s", entry.pre.vm_id, entry.key.name,
                exit_description(entry.pre.returncode),
                (time.monotonic() - entry.made_at) * 1000, tail or "(empty)",
                extra={"vm_id": entry.pre.vm_id, "op": "vmm_pool", "phase": "dead"})


_SIZES: dict[Path, int] = {}  # snapshot -> guest MiB (a snapshot never changes)


def _memory_mib(key: Path) -> int:
    """The guest memory of snapshot ``key`` (its manifest's), in MiB; 0 when unreadable."""
    if key not in _SIZES:
        try:
            _SIZES[key] = snap.read_manifest(key).memory_size >> 20
        except Exception:
            return 0
    return _SIZES[key]
