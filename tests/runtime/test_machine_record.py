"""The drivers' persisted machine records (``aenv.runtime.machine_record``): frozen,
versioned dataclasses that read back what they wrote, still read the version-less records
written before, and refuse a version they do not know before anything starts. No VM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aenv.runtime import MachineRecordError, RestoreOverrides, SnapshotError
from aenv.runtime import workdir as wd
from aenv.runtime.base import Drive, VMSpec
from aenv.runtime.firecracker_snapshot import FirecrackerMachine, MachineNetwork
from aenv.runtime.firecracker_snapshot import MachineDrive as FcDrive
from aenv.runtime.qemu import QemuRuntime
from aenv.runtime.qemu_snapshot import MachineDrive, QemuMachine, read_machine
from aenv.storage import snapshots

# A qemu machine record as aenv wrote it before records had a version.
QEMU_V0 = {
    "vcpus": 2, "memory_mib": 512, "accel": "tcg", "kernel": "/k/vmlinuz",
    "initrd": "/k/initrd", "boot_args": "console=ttyS0", "mac": "02:fc:00:00:00:05",
    "tap": "tap0", "memory_file": True,
    "drives": [{"id": "rootfs", "format": "qcow2", "read_only": False},
               {"id": "data", "format": "raw", "read_only": True}],
}
FIRECRACKER_V0 = {
    "vcpus": 1, "memory_mib": 256, "track_dirty_pages": True, "kernel": "/k/vmlinux",
    "initrd": None, "boot_args": "console=ttyS0 reboot=k",
    "drives": [{"id": "rootfs", "read_only": False, "root": True}],
    "network": {"iface_id": "eth0", "host_dev_name": "tap0", "guest_mac": "02:fc:00:00:00:05"},
    "firecracker_version": "1.16.1",
}


def test_a_qemu_record_without_a_version_reads_as_version_1_and_writes_the_same_fields() -> None:
    m = QemuMachine.from_json(QEMU_V0, "vm.json")
    assert m.kernel == Path("/k/vmlinuz") and m.drives[0] == MachineDrive("rootfs", "qcow2", False)
    assert m.memory_size == 512 << 20
    assert m.to_json() == {"version": 1, **QEMU_V0}
    assert QemuMachine.from_json(m.to_json(), "vm.json") == m


def test_a_qemu_record_is_made_from_the_spec_it_boots(tmp_path) -> None:
    (tmp_path / "vmlinuz").write_bytes(b"")
    spec = VMSpec(vm_id="v", workdir=tmp_path / "w", kernel=tmp_path / "vmlinuz",
                  boot_args="quiet", drives=(Drive("rootfs", tmp_path / "r.qcow2",
                                                   format="qcow2"),),
                  memory_file=tmp_path / "mem")
    m = QemuMachine.of(spec, "kvm")
    assert (m.accel, m.kernel, m.initrd, m.memory_file, m.tap) == \
        ("kvm", (tmp_path / "vmlinuz").resolve(), None, True, None)
    assert m.drives == (MachineDrive("rootfs", "qcow2", False),)


def test_a_firecracker_record_without_a_version_reads_as_version_1() -> None:
    m = FirecrackerMachine.from_json(FIRECRACKER_V0, "vm.json")
    assert m.network == MachineNetwork("eth0", "tap0", "02:fc:00:00:00:05")
    assert m.drives == (FcDrive("rootfs", False, True),) and m.initrd is None
    assert m.to_json() == {"version": 1, **FIRECRACKER_V0}
    assert FirecrackerMachine.from_json(m.to_json(), "vm.json") == m
    assert m.with_tap("tap9").network == MachineNetwork("eth0", "tap9", "02:fc:00:00:00:05")


@pytest.mark.parametrize("record", [QemuMachine, FirecrackerMachine])
def test_a_record_of_another_version_is_refused_naming_it(record) -> None:
    data = {**(QEMU_V0 if record is QemuMachine else FIRECRACKER_V0), "version": 2}
    with pytest.raises(MachineRecordError, match=r"snap/snapshot.json: .* version 2; this aenv "
                                                 r"reads version 1"):
        record.from_json(data, "snap/snapshot.json")


@pytest.mark.parametrize("record", [QemuMachine, FirecrackerMachine])
def test_a_malformed_record_is_refused(record) -> None:
    data = dict(QEMU_V0 if record is QemuMachine else FIRECRACKER_V0)
    del data["vcpus"]
    with pytest.raises(MachineRecordError, match="malformed"):
        record.from_json(data, "vm.json")
    with pytest.raises(MachineRecordError, match="not an object"):
        record.from_json(["vcpus"], "vm.json")


def test_a_machine_record_error_is_a_snapshot_error() -> None:
    assert issubclass(MachineRecordError, SnapshotError)


def test_a_working_directory_with_an_unknown_record_version_is_refused(tmp_path) -> None:
    (tmp_path / wd.MANIFEST).write_text(json.dumps({"machine": {**QEMU_V0, "version": 7}}))
    with pytest.raises(MachineRecordError, match="version 7"):
        read_machine(tmp_path)
    (tmp_path / wd.MANIFEST).write_text(json.dumps({"machine": QEMU_V0}))
    assert read_machine(tmp_path).vcpus == 2


async def test_a_qemu_restore_of_an_unknown_record_version_starts_nothing(tmp_path) -> None:
    snap = tmp_path / "snap"
    staging = snapshots.begin(snap)
    (staging / snapshots.DEVICE_STATE).write_bytes(b"state")
    with open(staging / snapshots.MEMORY, "wb") as f:
        f.truncate(1 << 20)
    snapshots.commit(staging, snap, snapshots.Manifest(
        driver="qemu", vm={**QEMU_V0, "version": 2, "drives": []}, memory_size=1 << 20,
        layers=(snapshots.MemoryLayer(snap, "full", 0),), drives=()))
    workdir = tmp_path / "vm"
    with pytest.raises(MachineRecordError, match="version 2"):
        await QemuRuntime().restore(snap, RestoreOverrides(vm_id="v", workdir=workdir))
    assert not workdir.exists()
