"""Runtime drivers behind one interface (``aenv.runtime.base``); ``get_runtime`` picks one.

``qemu`` runs everywhere (KVM or TCG); ``firecracker`` needs a ``firecracker`` binary and
hardware KVM. ``doctor_checks`` reports what this host gives each driver (VMM binaries,
accelerator and why, QMP library, what Firecracker lacks) as rows for ``aenv doctor``.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from .base import (
    VM,
    AttachError,
    BootError,
    ControlError,
    DeferredMemory,
    Drive,
    MachineRecordError,
    MemoryWriteAbandoned,
    NotSupportedError,
    RestoreOverrides,
    Runtime,
    SnapshotError,
    SnapshotInfo,
    UnknownRuntimeError,
    VMError,
    VMExitedError,
    VMLimits,
    VMSpec,
)
from .confine import Confinement

__all__ = [
    "VM",
    "AttachError",
    "BootError",
    "Confinement",
    "ControlError",
    "DeferredMemory",
    "Drive",
    "MachineRecordError",
    "MemoryWriteAbandoned",
    "NotSupportedError",
    "RestoreOverrides",
    "Runtime",
    "SnapshotError",
    "SnapshotInfo",
    "UnknownRuntimeError",
    "VMError",
    "VMExitedError",
    "VMLimits",
    "VMSpec",
    "doctor_checks",
    "get_runtime",
]

RUNTIMES = ("qemu", "firecracker")


def get_runtime(name: str, *, confinement: Confinement | None = None,
                track_writes: Path | None = None) -> Runtime:
    """The driver called ``name`` (``Settings.runtime``). ``confinement``: how its VMMs are
    confined (default ``Confinement()``; a server passes ``Confinement.from_settings``).
    ``track_writes``: QEMU's, see ``QemuRuntime`` (Firecracker tracks dirty pages itself)."""
    if name == "qemu":
        from .qemu import QemuRuntime

        return QemuRuntime(confinement=confinement, track_writes=track_writes)
    if name == "firecracker":
        from .firecracker import FirecrackerRuntime

        return FirecrackerRuntime(confinement=confinement)
    raise UnknownRuntimeError(f"unknown runtime {name!r}; available: {', '.join(RUNTIMES)}")


def doctor_checks() -> list[tuple[str, str]]:
    """(check, result) rows: QEMU version, accelerator with its reason, async I/O, QMP,
    then Firecracker's binary, KVM and what it is missing."""
    from . import firecracker
    from .kvm import host_accel
    from .qemu import io_uring_usable, qemu_binary, qemu_version

    binary = qemu_binary()
    version = qemu_version() if binary else None
    try:
        qmp = "qemu.qmp " + metadata.version("qemu.qmp")
    except metadata.PackageNotFoundError:
        qmp = "missing (pip install qemu.qmp)"
    choice = host_accel()
    return [
        ("qemu", f"{binary} {version}" if binary else "missing (apt-get install qemu-system-x86)"),
        ("accelerator", f"{choice.accel}: {choice.reason}"),
        ("disk aio", "io_uring" if io_uring_usable() else "threads (io_uring unavailable)"),
        ("qmp client", qmp),
        *firecracker.doctor_checks(),
    ]
