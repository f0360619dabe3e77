"""A qemu snapshot that fails part-way gives the VM back as it was (the recipe's undo stack,
``aenv.runtime.snapshot_recipe``) and raises one ``SnapshotError``: a running VM runs on,
a paused one stays paused, a pause that fails before its commit thaws the VM, and no
snapshot directory or staging directory is left. One booted guest for the module; the
failures are injected into the driver's steps (a full disk while switching drives, a
commit that cannot be made durable)."""

from __future__ import annotations

import errno
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from aenv.runtime import SnapshotError
from aenv.runtime import qemu_snapshot as qs
from aenv.storage import snapshots
from tests.runtime.conftest import VM_PREFIX, Guest, boot_guest, destroy_guest

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
async def guest(rt_settings, kernel, base_image, slot_pool) -> AsyncIterator[Guest]:
    g = await boot_guest(VM_PREFIX + "f", rt_settings, kernel, base_image, slot_pool)
    yield g
    await destroy_guest(g, slot_pool)


def nothing_left(directory: Path) -> bool:
    return not directory.exists() and not list(directory.parent.glob(
        f".{directory.name}.partial-*"))


def healthy(guest: Guest) -> bool:
    return httpx.get(guest.url + "/health", timeout=10).status_code == 204


async def full_disk(*args, **kwargs) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


async def test_a_running_snapshot_that_fails_while_frozen_leaves_the_vm_running(
        guest: Guest, tmp_path, monkeypatch) -> None:
    top = guest.vm.active_drive("rootfs")
    monkeypatch.setattr(qs, "_switch_drive", full_disk)
    with pytest.raises(SnapshotError, match="No space left") as err:
        await guest.vm.snapshot(tmp_path / "s1")
    assert isinstance(err.value.__cause__, OSError) and err.value.vm_lost is False
    assert await guest.vm.status() == "running" and healthy(guest)
    assert nothing_left(tmp_path / "s1")
    assert guest.vm.active_drive("rootfs") == top  # the lineage did not move


async def test_a_paused_vm_stays_paused_when_its_snapshot_fails(guest: Guest, tmp_path,
                                                               monkeypatch) -> None:
    monkeypatch.setattr(qs, "_switch_drive", full_disk)
    await guest.vm.pause()
    try:
        with pytest.raises(SnapshotError):
            await guest.vm.snapshot(tmp_path / "s2")
        assert await guest.vm.status() == "paused"
    finally:
        await guest.vm.resume()
    assert nothing_left(tmp_path / "s2") and healthy(guest)


async def test_a_pause_that_fails_before_its_commit_gives_the_vm_back_running(
        guest: Guest, tmp_path, monkeypatch) -> None:
    def cannot_commit(*args, **kwargs) -> None:
        raise snapshots.SnapshotFilesError("cannot commit the snapshot: Input/output error")

    top = guest.vm.active_drive("rootfs")
    monkeypatch.setattr(qs.snap, "commit", cannot_commit)
    with pytest.raises(SnapshotError, match="Input/output error") as err:
        await guest.vm.snapshot(tmp_path / "s3", stop=True)
    assert err.value.vm_lost is False and guest.vm.is_alive()
    assert await guest.vm.status() == "running" and healthy(guest)
    assert nothing_left(tmp_path / "s3") and top.exists()


async def test_after_the_failures_a_snapshot_is_taken_and_the_vm_runs_on(guest: Guest,
                                                                        tmp_path) -> None:
    info = await guest.vm.snapshot(tmp_path / "ok")
    assert snapshots.read_manifest(tmp_path / "ok").driver == "qemu"
    assert 0 < info.freeze_s < info.total_s
    assert await guest.vm.status() == "running" and healthy(guest)


async def test_a_snapshot_that_fails_after_its_drive_switch_still_names_the_file_the_vm_writes(
        guest: Guest, tmp_path, monkeypatch) -> None:
    def cannot_commit(*args, **kwargs) -> None:
        raise snapshots.SnapshotFilesError("cannot commit the snapshot: Input/output error")

    top = guest.vm.active_drive("rootfs")
    overlays = sorted(p.name for p in guest.vm.workdir.glob("rootfs*"))
    monkeypatch.setattr(qs.snap, "commit", cannot_commit)
    with pytest.raises(SnapshotError):
        await guest.vm.snapshot(tmp_path / "s4")
    blocks = (await guest.vm.execute("query-block"))["return"]
    (rootfs,) = [b for b in blocks if b["device"] == "rootfs"]
    name = rootfs["inserted"]["file"]  # json:{...} when the chain is not the header's
    if name.startswith("json:"):
        name = json.loads(name.removeprefix("json:"))["file"]["filename"]
    writes_to = (guest.vm.workdir / name).resolve()
    assert guest.vm.active_drive("rootfs") == writes_to == top
    assert not rootfs["inserted"]["ro"] and await guest.vm.status() == "running"
    assert healthy(guest) and nothing_left(tmp_path / "s4")
    assert sorted(p.name for p in guest.vm.workdir.glob("rootfs*")) == overlays
