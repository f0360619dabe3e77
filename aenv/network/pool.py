"""``SlotPool``: hands out network slots, keeps a few warm, recycles released ones.

Indices come from the range ``Addressing`` allows, never-used ones first, then the one freed
longest ago. A small number of slots (``warm_size``, default ``Settings.warm_slots``) is kept
created ahead of demand by one background thread, so ``acquire`` is usually a list pop plus,
only for a non-default egress policy, one nft call. ``release`` checks synchronously that the
VMM let go of the tap, then the background thread cleans the slot (default policy, conntrack
flushed in the namespace and for its host address on the host) and either keeps it warm or
destroys it and frees the index; a slot is never handed out again before that cleaning
finished. The thread does its work between bursts of acquires and VM starts, not during
them (``_QUIET_S``, ``starting``).

The host table is the pool's too (``host.HostTable``): ``start`` loads it, ``acquire``,
``adopt`` and every warm creation first check it is still there as loaded (restoring it,
or raising ``HostTableError`` so no slot goes out unisolated), and the background thread
checks it every ``host.CHECK_INTERVAL`` seconds, re-reading the default gateways.

Every method is thread-safe and blocking; from asyncio call them through
``asyncio.to_thread``. Run ``cleanup_leftovers`` before ``start`` after a crash, and give
``start`` the indices ``cleanup_leftovers`` kept so they are not handed out twice.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Self

from ..config import Settings
from . import access, host
from .addressing import Addressing
from .errors import NetworkError, PoolClosedError, PoolExhaustedError, SlotBusyError
from .policy import DEFAULT_POLICY, EgressPolicy
from .slot import EgressHook, NetworkSlot

log = logging.getLogger("aenv.network")

_RETRY_AFTER_FAILURE = 1.0  # seconds the filler waits after a failed creation
# The filler stays out of a burst's way: a fork takes 16 slots back to back and a batch of
# kills gives them back, and making or cleaning slots meanwhile (~50-150 ms of CPU each, nft
# included) only slows the burst down. It works once no VM start is in progress
# (``starting``) and acquire and release have been quiet for _QUIET_S, or once work has
# waited _MAX_DEFER_S, so a steady trickle of starts still finds slots made (with 10 s, a
# benchmark's back-to-back creates and resumes left a fork to make its slots on demand).
_QUIET_S = 0.5
_MAX_DEFER_S = 3.0


class SlotPool:
    def __init__(self, settings: Settings, *, warm_size: int | None = None,
                 tap_uid: int | None = None, tap_gid: int | None = None,
                 host_addresses: Iterable[str] = (), server_only: bool = False) -> None:
        """``tap_uid``/``tap_gid`` own every tap, for VMMs that do not run as root.
        ``host_addresses``: addresses of the machine aenv runs on that it cannot see from
        its namespace (see ``host``); no guest reaches them. ``server_only``: only
        sockets marked ``access.SERVER_MARK`` open connections to a slot's host address
        (the server's own clients must then be made with ``access``)."""
        self.addressing = Addressing(settings)
        self._host = host.HostTable(self.addressing, host_addresses,
                                    server_mark=access.SERVER_MARK if server_only else None)
        self._next_host_check = 0.0  # monotonic time of the filler's next host check
        self._host_failing: Exception | None = None  # the filler's last failed check
        self.warm_size = settings.warm_slots if warm_size is None else warm_size
        if self.warm_size < 0:
            raise ValueError("warm_size must be >= 0")
        self._tap_uid, self._tap_gid = tap_uid, tap_gid
        # Serves the egress listeners of slots whose policy names domains (aenv.egress);
        # set by the node before it hands out slots.
        self.egress: EgressHook | None = None
        self._cv = threading.Condition()
        self._warm: collections.deque[NetworkSlot] = collections.deque()
        self._leased: dict[int, NetworkSlot] = {}
        self._dirty: collections.deque[NetworkSlot] = collections.deque()
        self._reserved: set[int] = set()   # indices in use by someone, not free
        self._recycled: collections.deque[int] = collections.deque()  # freed, oldest first
        self._next_fresh = 1
        self._creating = 0
        self._cleaning = 0  # released slots taken off _dirty and not yet warm or freed
        self._starts = 0  # VM starts in progress (``starting``)
        self._bursts = 0  # of which a fan-out's (``starting(burst=True)``)
        self._last_busy = 0.0  # monotonic time of the last acquire or release
        self._pending_since: float | None = None  # since when the filler has had work
        self._started = False
        self._closed = False
        self._worker: threading.Thread | None = None
        self.last_error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, keep: Iterable[int] = ()) -> None:
        """Prepare the host (ip_forward, host table) and start filling the warm pool.
        ``keep``: indices of slots that survived a restart; only ``adopt`` hands them out."""
        with self._cv:
            if self._started:
                return
        self._host.load()
        with self._cv:
            if self._started:
                return
            self._next_host_check = time.monotonic() + host.CHECK_INTERVAL
            self._reserved.update(keep)
            self._started = True
            self._worker = threading.Thread(target=self._work, name="aenv-slot-pool",
                                            daemon=True)
            self._worker.start()

    def close(self, keep_leased: bool = False) -> None:
        """Stop the filler, destroy every slot this pool made or adopted (leased or not; stop
        their VMMs first) and remove the host table: a clean shutdown leaves no trace.
        ``keep_leased``: leave leased slots and the host table alone — their VMs keep
        running for the next server to adopt."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join()
        with self._cv:
            slots = [*self._warm, *self._dirty]
            slots_kept = bool(self._leased) and keep_leased
            if not keep_leased:
                slots += self._leased.values()
            self._warm.clear()
            self._dirty.clear()
            self._leased.clear()
        for slot in slots:
            try:
                slot.destroy()
            except NetworkError:
                log.exception("slot %d: destroy on close failed", slot.index)
        if self._started and not slots_kept:
            self._host.remove()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- handing out -----------------------------------------------------------------------

    def acquire(self, policy: EgressPolicy = DEFAULT_POLICY) -> NetworkSlot:
        """A clean slot with ``policy`` applied: a warm one if any, else made now.
        Raises HostTableError when the host table is gone and cannot be restored."""
        with self._cv:
            self._check_open()
        self._host.check()
        dirty = False
        with self._cv:
            self._check_open()
            # a warm slot, else the index of one to make now, else a released one not
            # cleaned yet: the filler holds its work during starts (a fan-out's, for as long
            # as they come back to back), and released slots must not run the range out
            picked: NetworkSlot | int
            if self._warm:
                picked = self._warm.popleft()
            else:
                try:
                    picked = self._take_index()
                except PoolExhaustedError:
                    if not self._dirty:
                        raise
                    picked, dirty = self._dirty.popleft(), True
            self._last_busy = time.monotonic()
            self._cv.notify_all()  # the filler tops the warm pool up again
        if dirty:
            assert isinstance(picked, NetworkSlot)
            try:
                picked.reset()
            except BaseException:
                self._retire(picked)
                raise
        if isinstance(picked, int):
            try:
                slot = NetworkSlot.create(self.addressing, picked, policy=policy,
                                          tap_uid=self._tap_uid, tap_gid=self._tap_gid,
                                          egress=self.egress)
            except BaseException:
                self._free_index(picked)
                raise
        else:
            slot = picked
            slot.egress = self.egress
            try:
                slot.set_policy(policy)
            except BaseException:
                self._retire(slot)
                raise
        return self._lease(slot)

    def adopt(self, index: int, policy: EgressPolicy = DEFAULT_POLICY) -> NetworkSlot:
        """Take over slot ``index`` that survived a server restart (see ``start(keep=)``)."""
        with self._cv:
            self._check_open()
            if index in self._leased:
                raise NetworkError(f"slot {index} is already leased")
        self._host.check()
        with self._cv:
            self._check_open()
            if index in self._leased:
                raise NetworkError(f"slot {index} is already leased")
            self._reserved.add(index)
        try:
            slot = NetworkSlot.attach(self.addressing, index, policy, self.egress)
        except BaseException:
            # Whatever is left of it is of no use: remove it so the index can be made anew.
            self._retire(NetworkSlot(self.addressing, self.addressing.slot(index),
                                     DEFAULT_POLICY))
            raise
        return self._lease(slot)

    def release(self, slot: NetworkSlot) -> None:
        """Give the slot back. Raises SlotBusyError (and keeps it leased) while a process
        still holds its tap; the cleaning itself happens in the background. After ``close``
        (which destroyed every slot) this does nothing."""
        with self._cv:
            if self._closed:
                return
            if self._leased.get(slot.index) is not slot:
                raise NetworkError(f"slot {slot.index} is not leased from this pool")
        if slot.tap_attached():
            raise SlotBusyError(slot.index)
        with self._cv:
            if self._leased.pop(slot.index, None) is None:
                return  # closed meanwhile: close destroyed it
            self._dirty.append(slot)
            self._last_busy = time.monotonic()
            self._cv.notify_all()

    @contextmanager
    def starting(self, *, burst: bool = False) -> Iterator[None]:
        """Around a VM start (slot acquired to guest ready): the filler holds its work until
        no start is in progress. A fork of 16 empties the pool, and refilling it at once
        (~0.4 s of this process's CPU) competed with the children coming up. ``burst``: a
        start of a fan-out whose starts all run at once (a fork's children): while one
        is in progress the filler waits without ``_MAX_DEFER_S`` (the fan-out ends by
        itself; under TCG a fork x16 outlasts 3 s, and its refill then ran during it)."""
        with self._cv:
            self._starts += 1
            self._bursts += burst
        try:
            yield
        finally:
            with self._cv:
                self._starts -= 1
                self._bursts -= burst
                self._last_busy = time.monotonic()
                self._cv.notify_all()

    def fanning_out(self) -> bool:
        """Whether a fan-out's start (``starting(burst=True)``: a fork's children) is in
        progress: what else would load the host then waits too (the metrics collector)."""
        with self._cv:
            return self._bursts > 0

    def stats(self) -> dict[str, int]:
        with self._cv:
            return {"warm": len(self._warm), "leased": len(self._leased),
                    "cleaning": len(self._dirty), "creating": self._creating,
                    "capacity": self.addressing.capacity}

    def wait_warm(self, timeout: float = 10.0) -> bool:
        """Block until the warm pool is full (for benchmarks and tests)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while len(self._warm) < self.warm_size or self._dirty or self._cleaning:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cv.wait(left)
            return True

    # -- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("slot pool is closed")
        if not self._started:
            raise NetworkError("slot pool not started")

    def _lease(self, slot: NetworkSlot) -> NetworkSlot:
        with self._cv:
            if not self._closed:
                self._leased[slot.index] = slot
                return slot
        slot.destroy()  # close ran while the slot was being made
        raise PoolClosedError("slot pool is closed")

    def _take_index(self) -> int:
        """A never-used index while any is left, else the one freed longest ago (caller
        holds the lock). An address goes as long as it can before a new sandbox answers on
        it, so a client still holding keep-alive connections to the old one, or a stray
        packet for it, meets a reset as rarely as the range allows."""
        while self._next_fresh <= self.addressing.capacity:
            index = self._next_fresh
            self._next_fresh += 1
            if index not in self._reserved:
                self._reserved.add(index)
                return index
        while self._recycled:
            index = self._recycled.popleft()
            if index not in self._reserved:
                self._reserved.add(index)
                return index
        raise PoolExhaustedError(f"all {self.addressing.capacity} network slots are in use")

    def _free_index(self, index: int) -> None:
        with self._cv:
            self._reserved.discard(index)
            if index < self._next_fresh:  # a higher one is still ahead of the fresh count
                self._recycled.append(index)
            self._cv.notify_all()

    def _retire(self, slot: NetworkSlot) -> None:
        try:
            slot.destroy()
        finally:
            self._free_index(slot.index)

    def _work(self) -> None:
        """The one background thread: check the host table when due, clean released slots
        first, then fill the pool."""
        while True:
            with self._cv:
                while not self._closed and not self._dirty and \
                        len(self._warm) + self._creating >= self.warm_size:
                    self._pending_since = None
                    due = self._next_host_check - time.monotonic()
                    if due <= 0:
                        break
                    self._cv.wait(due)
                if self._closed:
                    return
                host_check = time.monotonic() >= self._next_host_check
                if host_check:
                    self._next_host_check = time.monotonic() + host.CHECK_INTERVAL
            if host_check:
                self._check_host()
                continue
            with self._cv:
                if self._closed:
                    return
                hold = self._hold()
                if hold > 0:
                    self._cv.wait(hold)
                    continue
                dirty = self._dirty.popleft() if self._dirty else None
                index = None
                if dirty is not None:
                    self._cleaning += 1
                else:
                    try:
                        index = self._take_index()
                    except PoolExhaustedError:
                        self._cv.wait(_RETRY_AFTER_FAILURE)
                        continue
                    self._creating += 1
            if dirty is not None:
                try:
                    self._recycle(dirty)
                finally:
                    with self._cv:
                        self._cleaning -= 1
                        self._cv.notify_all()
            elif index is not None:
                self._fill(index)

    def _hold(self) -> float:
        """Seconds the filler should still wait before its next piece of work (lock held)."""
        now = time.monotonic()
        if self._pending_since is None:
            self._pending_since = now
        deadline = self._pending_since + _MAX_DEFER_S
        if self._bursts:  # no deadline: the fan-out's last start notifies
            self._pending_since = now
            return _QUIET_S
        if self._starts:  # the end of the last start notifies; re-check now and then
            return min(deadline - now, _QUIET_S)
        return min(self._last_busy + _QUIET_S, deadline) - now

    def _check_host(self) -> None:
        try:
            self._host.check(refresh=True)
        except Exception as e:  # kept, and logged once per outage; acquire raises it
            if self._host_failing is None:
                log.exception("host table check failed")
            self.last_error = self._host_failing = e
            return
        if self._host_failing is not None:
            log.info("host table restored after: %s", self._host_failing)
            self._host_failing = None

    def _recycle(self, slot: NetworkSlot) -> None:
        keep = False
        try:
            with self._cv:
                keep = len(self._warm) < self.warm_size
            if keep:
                slot.reset()
        except BaseException as e:
            self.last_error = e
            log.exception("slot %d: reset failed, destroying it", slot.index)
            keep = False
        if keep:
            with self._cv:
                self._warm.append(slot)
                self._cv.notify_all()
            return
        try:
            self._retire(slot)
        except BaseException as e:
            self.last_error = e
            log.exception("slot %d: destroy failed", slot.index)

    def _fill(self, index: int) -> None:
        try:
            self._host.check()
            slot = NetworkSlot.create(self.addressing, index, tap_uid=self._tap_uid,
                                      tap_gid=self._tap_gid)
        except BaseException as e:
            self.last_error = e
            log.exception("slot %d: warm creation failed", index)
            with self._cv:
                self._creating -= 1
            self._free_index(index)
            time.sleep(_RETRY_AFTER_FAILURE)
            return
        with self._cv:
            self._creating -= 1
            if self._closed:
                closed = True
            else:
                closed = False
                self._warm.append(slot)
                self._cv.notify_all()
        if closed:
            self._retire(slot)
