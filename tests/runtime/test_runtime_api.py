"""The runtime interface: driver lookup, spec validation, declared-but-later operations,
doctor rows, and how a failed boot is reported."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from aenv import runtime
from aenv.runtime import (
    BootError,
    Drive,
    RestoreOverrides,
    SnapshotError,
    UnknownRuntimeError,
    VMSpec,
    get_runtime,
)
from aenv.runtime.kvm import host_accel


def test_get_runtime_knows_qemu_and_names_what_exists() -> None:
    assert get_runtime("qemu").name == "qemu"
    with pytest.raises(UnknownRuntimeError, match="available: qemu"):
        get_runtime("xen")


def test_spec_rejects_duplicate_drive_ids_and_bad_names(tmp_path: Path) -> None:
    d = Drive("rootfs", tmp_path / "a")
    with pytest.raises(ValueError, match="duplicate"):
        VMSpec(vm_id="x", workdir=tmp_path, kernel=tmp_path / "k", boot_args="", drives=(d, d))
    with pytest.raises(ValueError, match="identifier"):
        Drive("root fs", tmp_path / "a")
    with pytest.raises(ValueError, match="format"):
        Drive("rootfs", tmp_path / "a", format="vmdk")  # type: ignore[arg-type]


async def test_restore_of_a_directory_that_is_no_snapshot_raises_snapshot_error(
        tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match=r"not a .*snapshot"):
        await get_runtime("qemu").restore(tmp_path, RestoreOverrides("x", tmp_path / "w"))
    assert not (tmp_path / "w").exists()


def test_doctor_rows_show_the_accelerator_decision() -> None:
    rows = dict(runtime.doctor_checks())
    choice = host_accel()
    assert rows["accelerator"] == f"{choice.accel}: {choice.reason}"
    assert set(rows) == {"qemu", "accelerator", "disk aio", "qmp client", "firecracker",
                         "firecracker kvm", "firecracker runtime"}


@pytest.mark.vm
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs qemu")
async def test_a_vmm_that_cannot_start_raises_boot_error_with_its_log(tmp_path: Path) -> None:
    spec = VMSpec(vm_id="broken", workdir=tmp_path / "vm", kernel=tmp_path / "no-such-kernel",
                  boot_args="console=ttyS0")
    with pytest.raises(BootError) as err:
        await get_runtime("qemu").boot(spec)
    assert "could not open kernel file" in err.value.vmm_log_tail
    assert err.value.vm_id == "broken"
    leftovers = [p for p in os.listdir("/proc") if p.isdigit() and _cwd(p) == str(spec.workdir)]
    assert leftovers == []


def _cwd(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
