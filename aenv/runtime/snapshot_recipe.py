"""The capture of a VM snapshot (``VM.snapshot``) as one recipe of named steps, shared by
every driver; each driver supplies the steps (``CaptureSteps``), the recipe runs them.

``capture`` runs, in this order and nothing else::

    plan → freeze → save_state → save_memory → drives → thaw → commit → finish

- ``plan``: all that can be done before the vCPUs stop: read the machine record and what
  the VM derives from, open the staging directory (``snapshots.begin``, with its undo),
  decide what each drive and the memory get, make files the VM will switch to, and learn
  whether the vCPUs run (``was_running``).
- ``freeze``: stop the vCPUs if they ran, and push the undo that runs them again.
- ``save_state``: the device (and vCPU) state into the staging directory.
- ``save_memory``: guest memory, or what of it changed (a driver whose VMM writes memory
  with the state does nothing here).
- ``drives``: each writable drive's layer, still frozen, so disk and memory are of one
  moment.
- ``thaw``: run the vCPUs again, and drop the freeze's undo — unless this is a pause
  (``stop``) or the caller had paused the VM; then it stays frozen.
- ``commit``: what is left to do off the freeze (compacting a chain, sorting out the
  memory layer), the manifest, and ``snapshots.commit`` (every file fsynced, renamed into
  place). From here the snapshot exists and nothing is undone.
- ``finish``: a pause ends the VMM (``Capture.vmm_stopped``), unless its memory is
  deferred (``VM.pause_deferred``: ``save_memory`` left a marker instead, and the VMM waits
  frozen for ``DeferredMemory.write``); a VM that runs on records the snapshot as what it
  derives from now.

Timing: the recipe times every step with one ``PhaseTimer`` (``Capture.timer``): one phase
per step, named after it, in ``Capture.phases``; a step may add finer phases of its own
(``timer.add``, e.g. QEMU's ``memory_copy``). ``frozen_at`` is the end of ``plan`` and
``thawed_at`` the end of ``thaw``; ``SnapshotInfo.freeze_s`` is the span between them,
``total_s`` runs from the start to the end of ``finish``. A driver whose VM stays frozen
through ``finish`` sets ``Capture.frozen_until_finish`` (Firecracker's pause: frozen until
its VMM is gone), and the freeze then ends with ``finish``.

Cleanup is a stack (``Undo``): a step that takes something pushes how to give it back (the
staging directory: remove it; frozen vCPUs: run them again). When a step fails, the recipe
unwinds the stack, last in first out, then translates the error; an undo that fails is
logged and never hides the error it cleans up after. The stack is dropped once ``commit``
returns.

Errors are translated at this boundary, in one place (``translate``): ``SnapshotError`` and
``NotSupportedError`` pass as they are; any other ``Exception`` (a driver's ``VMError``,
``StorageError``, ``OSError``, or a bug) becomes a ``SnapshotError`` chained to it, with the
VMM's log tail. ``vm_lost`` says the VMM is gone: ended by this capture's ``finish``, or
not alive once the undos ran. Cancellation propagates as itself, after the undos.
"""

from __future__ import annotations

import abc
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..phase_timer import PhaseTimer
from . import workdir as wd
from .base import NotSupportedError, SnapshotError, SnapshotInfo

log = logging.getLogger("aenv.runtime")

UndoAction = Callable[[], Awaitable[None] | None]


class Undo:
    """A stack of ways to give back what a capture took, run last in, first out."""

    def __init__(self, vm_id: str) -> None:
        self.vm_id = vm_id
        self._stack: list[tuple[str, UndoAction]] = []

    def push(self, what: str, action: UndoAction) -> None:
        """Remember how to give back ``what`` (a plain or an async callable)."""
        self._stack.append((what, action))

    def drop(self, what: str) -> None:
        """Forget the latest undo named ``what``: a later step gave it back itself."""
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] == what:
                del self._stack[i]
                return
        raise KeyError(what)

    def clear(self) -> None:
        self._stack.clear()

    def __contains__(self, what: str) -> bool:
        return any(name == what for name, _ in self._stack)

    async def unwind(self) -> None:
        """Run every undo, newest first. A failing undo is logged and the rest still run;
        a cancellation during the unwinding is raised once all have run."""
        interrupted: BaseException | None = None
        while self._stack:
            what, action = self._stack.pop()
            try:
                result = action()
                if inspect.isawaitable(result):
                    await result
            except Exception as e:
                log.warning("snapshot of %s: undoing %s failed: %s", self.vm_id, what, e,
                            extra={"vm_id": self.vm_id, "op": "snapshot"})
            except BaseException as e:
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted


@dataclass
class Capture:
    """One capture in progress, as every step sees it."""

    vm_id: str
    directory: Path
    stop: bool
    incremental: bool
    undo: Undo
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    frozen_at: float = 0.0
    thawed_at: float = 0.0
    vmm_stopped: bool = False  # ``finish`` ended the VMM (a pause)
    frozen_until_finish: bool = False  # the freeze lasts through ``finish`` (see above)

    @property
    def phases(self) -> dict[str, float]:
        """Seconds per step (and per finer phase a step added), in the order they ran."""
        return self.timer.phases


@dataclass(frozen=True)
class Captured:
    """What ``commit`` made: the figures ``SnapshotInfo`` reports. ``method``: how memory
    was taken, for the log (driver-specific: ``full``, ``diff``...)."""

    parent: Path | None
    memory_bytes: int
    memory_layers: int
    disk_bytes: int
    compacted: bool
    method: str


class CaptureSteps(abc.ABC):
    """A driver's implementation of the recipe's steps for one capture of one VM (a new
    object per capture: the steps keep what they decided on it). See the module docstring
    for what each step must do."""

    vm_id: str
    workdir: Path

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """Whether the VMM still runs."""

    @abc.abstractmethod
    async def plan(self, c: Capture) -> None: ...

    @abc.abstractmethod
    async def freeze(self, c: Capture) -> None: ...

    @abc.abstractmethod
    async def save_state(self, c: Capture) -> None: ...

    @abc.abstractmethod
    async def save_memory(self, c: Capture) -> None: ...

    @abc.abstractmethod
    async def drives(self, c: Capture) -> None: ...

    @abc.abstractmethod
    async def thaw(self, c: Capture) -> None: ...

    @abc.abstractmethod
    async def commit(self, c: Capture) -> Captured: ...

    @abc.abstractmethod
    async def finish(self, c: Capture) -> None: ...


async def capture(steps: CaptureSteps, directory: Path, *, stop: bool,
                  incremental: bool) -> SnapshotInfo:
    """Run the recipe (see the module docstring); raises ``SnapshotError`` (or
    ``NotSupportedError``), after which the VM is as it was unless ``vm_lost``."""
    c = Capture(steps.vm_id, directory, stop=stop, incremental=incremental,
                undo=Undo(steps.vm_id))
    t = c.timer
    try:
        await steps.plan(c)
        c.frozen_at = t.mark("plan")
        await steps.freeze(c)
        t.mark("freeze")
        await steps.save_state(c)
        t.mark("save_state")
        await steps.save_memory(c)
        t.mark("save_memory")
        await steps.drives(c)
        t.mark("drives")
        await steps.thaw(c)
        c.thawed_at = t.mark("thaw")
        result = await steps.commit(c)
        t.mark("commit")
        c.undo.clear()
        await steps.finish(c)
        finished = t.mark("finish")
        if c.frozen_until_finish:
            c.thawed_at = finished
    except BaseException as e:
        await c.undo.unwind()
        if not isinstance(e, Exception):
            raise
        error = translate(e, steps, c)
        if error is e:
            raise
        raise error from e
    info = SnapshotInfo(
        directory=directory, parent=result.parent, freeze_s=c.thawed_at - c.frozen_at,
        total_s=finished - t.started, memory_bytes=result.memory_bytes,
        memory_layers=result.memory_layers, disk_bytes=result.disk_bytes,
        compacted=result.compacted, phases=c.phases)
    log.info("snapshot %s -> %s (%s, %d layers, %d KiB memory) frozen %.0f ms of %.0f ms",
             steps.vm_id, directory, result.method, info.memory_layers,
             info.memory_bytes >> 10, info.freeze_s * 1000, info.total_s * 1000,
             extra={"vm_id": steps.vm_id, "op": "snapshot", "phase": result.method,
                    "duration": info.total_s, "freeze": info.freeze_s, "stop": stop})
    return info


def translate(error: Exception, steps: CaptureSteps, c: Capture) -> Exception:
    """The error a failed capture raises (see the module docstring): ``error`` itself, or a
    ``SnapshotError`` that wraps it."""
    lost = c.vmm_stopped or not steps.is_alive()
    if isinstance(error, NotSupportedError):
        return error
    if isinstance(error, SnapshotError):
        error.vm_lost = error.vm_lost or lost
        error.vm_id = error.vm_id or steps.vm_id
        return error
    return SnapshotError(f"snapshot of {steps.vm_id} into {c.directory} failed: {error}",
                         vm_id=steps.vm_id, vm_lost=lost,
                         vmm_log_tail=wd.tail(steps.workdir / wd.VMM_LOG))
