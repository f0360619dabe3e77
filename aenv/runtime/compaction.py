"""Background compaction of snapshot chains: the heavy part of keeping chains short, off
every capture's path (issue 21: a snapshot request waits only for what must be consistent).

``Compactor.schedule(directory)`` after each capture queues the snapshot; one worker takes
the queue in order and, per snapshot, runs the driver's ``Runtime.prepare_compaction`` in a
thread (O(data in the chain); None when the chain is short enough), then ``install``s the
result under the caller's snapshot lock (the lock that also serialises captures and garbage
collection), and ``release``s it ``release_after_s`` later, under the lock again. Failures
are logged: the snapshot keeps its longer chain, which restores all the same.

What is compacted: each qcow2 drive chain deeper than the driver's ``max_chain`` (flattened
onto its root), and the memory stack when it has more than ``max_chain`` diff layers (merged
into one diff, ``aenv.storage.memory_compaction``: its ``install`` rewrites the manifest to
the short stack and lists the old layers as retired; ``release`` drops that list).

Crash safety (the server may die at any moment): the snapshot directory restores before,
during and after every step. Until ``install`` the flattened copy is a hidden file beside
the drive file; ``install`` is a rename of a file already fsynced; until ``release`` the
manifest still names the old chain, so nothing is collected that a reader might still be
opening. ``recover(snapshots_dir)`` at start-up queues every snapshot again: the driver
removes an interrupted compaction's leftovers and redoes what is missing (a release only,
when the file was installed already).

Callers: the node (``aenv.orchestrator.node``, with its snapshot lock), benchmarks; tests
wait for the queue with ``settle``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from ..phase_timer import PhaseTimer
from .base import Compaction, Runtime

log = logging.getLogger("aenv.runtime")

RELEASE_AFTER_S = 10.0  # a reader that opened the old file has opened its chain by then


class Compactor:
    """One node's queue of snapshots to compact (see the module docstring). ``history``
    keeps the last compactions' durations (seconds per step) for benchmarks and tests."""

    def __init__(self, runtime: Runtime, lock: asyncio.Lock, *,
                 release_after_s: float = RELEASE_AFTER_S) -> None:
        self.runtime = runtime
        self.lock = lock
        self.release_after_s = release_after_s
        self.history: list[dict[str, float]] = []
        self._queue: list[Path] = []
        self._worker: asyncio.Task[None] | None = None
        self._releases: set[asyncio.Task[None]] = set()
        self._closed = False

    def schedule(self, directory: Path) -> None:
        """Queue ``directory`` (a complete snapshot) unless it is queued already."""
        if self._closed or directory in self._queue:
            return
        self._queue.append(directory)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work(), name="aenv-compaction")

    def recover(self, snapshots_dir: Path) -> int:
        """Queue every snapshot of ``snapshots_dir`` (start-up: what a stopped server left
        half-compacted, or never compacted, is finished). Returns how many were queued."""
        if not snapshots_dir.is_dir():
            return 0
        found = sorted(d for d in snapshots_dir.iterdir()
                       if d.is_dir() and not d.name.startswith("."))
        for d in found:
            self.schedule(d)
        return len(found)

    @property
    def busy(self) -> bool:
        return bool(self._queue) or bool(self._releases) or (
            self._worker is not None and not self._worker.done())

    async def settle(self) -> None:
        """Until the queue is empty and every release has run."""
        while self.busy:
            pending = [t for t in (self._worker, *self._releases) if t is not None]
            await asyncio.wait(pending)

    async def close(self) -> None:
        """Stop: the queue is dropped and the steps under way are cancelled (a thread
        already flattening runs to its end; its file is removed at the next start)."""
        self._closed = True
        self._queue.clear()
        tasks = [t for t in (self._worker, *self._releases) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _work(self) -> None:
        while self._queue:
            directory = self._queue.pop(0)
            try:
                await self._compact(directory)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("compaction of %s failed, its chain stays as it is: %s",
                            directory, e, extra={"op": "compaction"})

    async def _compact(self, directory: Path) -> None:
        timer = PhaseTimer()
        job = await asyncio.to_thread(self.runtime.prepare_compaction, directory)
        if job is None:
            return
        timer.mark("flatten")
        try:
            async with self.lock:
                installed = await asyncio.to_thread(job.install)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(job.discard))
            raise
        timer.mark("install")
        if not installed:
            return
        self.history = [*self.history[-99:], timer.phases]
        log.info("snapshot %s: chain compacted in the background (%s)", directory,
                 timer.summary(), extra={"op": "compaction", "duration": timer.elapsed()})
        task = asyncio.create_task(self._release(job), name="aenv-compaction-release")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, job: Compaction) -> None:
        await asyncio.sleep(self.release_after_s)
        try:
            async with self.lock:
                await asyncio.to_thread(job.release)
        except Exception as e:
            log.warning("compaction of %s: releasing the old chain failed (kept): %s",
                        job.directory, e, extra={"op": "compaction"})
