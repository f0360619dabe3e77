"""Guest readiness: wait for envd's ``/health`` and time the boot from the serial console.

``Runtime.boot`` returns when the VMM runs; the caller then waits here for the guest.
``wait_for_envd`` polls ``GET /health`` until it answers 204, and fails early with a
``BootError`` carrying the console tail when the VMM exits meanwhile.

``ConsoleWatcher`` follows a VM's console log while it boots and stamps, on the host's
monotonic clock, the moment each boot-phase marker printed by the guest init appears (the
serial console is written synchronously by the VMM, so a line's arrival is its print time to
within the poll interval). ``BootPhases`` turns those stamps into the boot breakdown, and
``boot_until_ready`` does all of it: boot, wait for envd, log and return the phases.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from ..client.http import plain_client
from ..guest import markers
from .base import VM, BootError, Runtime, VMSpec
from .workdir import CONSOLE, tail

log = logging.getLogger("aenv.runtime")

FIRST_MARKERS = ("aenv-initrd:start", "aenv-init:start")
ENVD_MARKER = "aenv-init:envd-exec"
HEALTH_POLL = 0.02  # seconds between /health attempts
CONSOLE_POLL = 0.01  # seconds between console log reads


async def wait_for_envd(url: str, timeout: float = 30.0, *, vm: VM | None = None) -> float:
    """Poll ``{url}/health`` until 204; return the host monotonic time it first answered.

    Raises ``BootError`` (with the console tail) if ``vm``'s VMM exits or ``timeout`` passes.
    """
    deadline = time.monotonic() + timeout
    last: str = "no answer"
    async with plain_client(timeout=1.0) as client:
        while True:
            if vm is not None and not vm.is_alive():
                raise BootError("VMM exited before envd answered", vm_id=vm.vm_id,
                                console_tail=tail(vm.console_log))
            try:
                r = await client.get(url.rstrip("/") + "/health")
                if r.status_code == 204:
                    return time.monotonic()
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = type(e).__name__
            if time.monotonic() > deadline:
                raise BootError(
                    f"envd at {url} not healthy within {timeout}s ({last})",
                    vm_id=vm.vm_id if vm else None,
                    console_tail=tail(vm.console_log) if vm else "",
                )
            await asyncio.sleep(HEALTH_POLL)


@dataclass
class ConsoleWatcher:
    """Stamps marker lines of ``path`` with the host monotonic time they appeared.

    Use as ``async with ConsoleWatcher(vm.console_log) as w: ...``; ``w.seen`` maps each
    marker key (``aenv-init:envd-exec``, see ``aenv.guest.markers``) to
    ``(host_time, guest_uptime)`` of its first occurrence.
    """

    path: Path
    seen: dict[str, tuple[float, float]] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _offset: int = 0
    _partial: bytes = b""

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._follow())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._read()  # whatever arrived after the last poll

    async def _follow(self) -> None:
        while True:
            self._read()
            await asyncio.sleep(CONSOLE_POLL)

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:  # truncated: a new boot
                    self._offset, self._partial = 0, b""
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        if not chunk:
            return
        now = time.monotonic()
        self._offset += len(chunk)
        data = self._partial + chunk
        complete, _, self._partial = data.rpartition(b"\n")
        for marker in markers.parse(complete.decode(errors="replace")):
            self.seen.setdefault(marker.key, (now, marker.uptime))


@dataclass(frozen=True)
class BootPhases:
    """One boot, split into phases (seconds, host clock unless named ``guest_``)."""

    vmm_to_qmp: float  # spawn of the VMM -> QMP answered
    kernel_to_init: float  # QMP answered (guest starts) -> first init marker
    init_to_envd_exec: float  # first init marker -> init execs envd
    envd_exec_to_health: float  # envd exec -> /health answered 204
    total: float  # spawn -> /health 204
    guest_uptime_at_init: float  # the kernel's share as the guest measured it

    @classmethod
    def from_stamps(
        cls,
        *,
        started_at: float,
        qmp_ready: float,
        seen: dict[str, tuple[float, float]],
        healthy_at: float,
    ) -> BootPhases:
        """Build from a ``ConsoleWatcher``'s stamps; ``qmp_ready`` is seconds after spawn.

        The first init marker is the initramfs's start (cloud kernel) or else the image
        init's start (kernels without an initramfs).
        """
        first = next((k for k in FIRST_MARKERS if k in seen), None)
        if first is None or ENVD_MARKER not in seen:
            raise ValueError(f"boot markers missing on the console (saw {sorted(seen)})")
        t_init, up_init = seen[first]
        t_envd, _ = seen[ENVD_MARKER]
        t_qmp = started_at + qmp_ready
        return cls(
            vmm_to_qmp=qmp_ready,
            kernel_to_init=t_init - t_qmp,
            init_to_envd_exec=t_envd - t_init,
            envd_exec_to_health=healthy_at - t_envd,
            total=healthy_at - started_at,
            guest_uptime_at_init=up_init,
        )


async def boot_until_ready(
    runtime: Runtime, spec: VMSpec, envd_url: str, timeout: float = 60.0
) -> tuple[VM, BootPhases]:
    """Boot ``spec`` and wait until envd at ``envd_url`` is healthy, timing every phase.

    If envd does not come up the VM is stopped before the ``BootError`` propagates.
    """
    async with ConsoleWatcher(spec.workdir / CONSOLE) as console:
        vm = await runtime.boot(spec)
        try:
            healthy = await wait_for_envd(envd_url, timeout, vm=vm)
        except BaseException:
            await vm.stop()
            raise
    phases = BootPhases.from_stamps(started_at=vm.started_at,
                                    qmp_ready=vm.boot_timings["qmp_ready"],
                                    seen=console.seen, healthy_at=healthy)
    log.info(
        "%s ready in %.2f s (vmm %.2f, kernel %.2f, init %.2f, envd %.2f)", spec.vm_id,
        phases.total, phases.vmm_to_qmp, phases.kernel_to_init, phases.init_to_envd_exec,
        phases.envd_exec_to_health,
        extra={"vm_id": spec.vm_id, "op": "boot", "phase": "envd_ready", "duration": phases.total},
    )
    return vm, phases
