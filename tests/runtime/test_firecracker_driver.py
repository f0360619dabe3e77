"""The Firecracker driver against a fake ``firecracker`` process: the API contract it keeps.

Each test runs the real driver against ``fake_firecracker.py`` installed as ``firecracker``
on a temporary PATH: a real process, in its own process group, serving a real unix socket,
recording every request. The tests assert the exact request sequence and bodies for boot,
pause, resume, snapshot, restore and stop, validate every body against the published
v1.16.1 schema, and check the error mapping. They prove the driver speaks Firecracker's
published API as documented; they do not prove a guest boots (see test_firecracker_vm.py).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from aenv.network.guest_link import GUEST_MAC
from aenv.runtime import (
    AttachError,
    BootError,
    ControlError,
    Drive,
    MachineRecordError,
    NotSupportedError,
    RestoreOverrides,
    VMExitedError,
    VMSpec,
    get_runtime,
)
from aenv.runtime import firecracker as fcd
from aenv.runtime import firecracker_api as fc
from aenv.runtime import firecracker_snapshot as fcsnap
from aenv.runtime import workdir as wd
from aenv.runtime.base import SnapshotError
from aenv.runtime.firecracker import FirecrackerRuntime, FirecrackerVM
from aenv.runtime.firecracker_snapshot import FirecrackerMachine
from aenv.runtime.kvm import AccelChoice
from aenv.storage import snapshots
from tests.runtime.firecracker_contract import FakeFirecracker, check_request

KVM = AccelChoice("kvm", "test: pretend hardware KVM")
MEM_MIB = 32
PAGE = snapshots.PAGE_SIZE


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeFirecracker]:
    f = FakeFirecracker.install(tmp_path)
    monkeypatch.setenv("PATH", f"{f.bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_FC_RECORD", str(f.record))
    yield f
    for start in f.starts():  # no fake may outlive its test
        try:
            os.kill(start["pid"], 0)
        except ProcessLookupError:
            continue
        os.kill(start["pid"], signal.SIGKILL)
        pytest.fail(f"fake firecracker {start['pid']} was left running")


@pytest.fixture
def host_files(tmp_path: Path) -> dict[str, Path]:
    kernel = tmp_path / "vmlinux"
    kernel.write_bytes(b"\x7fELF" + b"\0" * 60)
    initrd = tmp_path / "initrd.img"
    initrd.write_bytes(b"070701")
    rootfs = tmp_path / "disk.raw"
    with open(rootfs, "wb") as f:
        f.write(b"root-v1")
        f.truncate(1 << 20)
    data = tmp_path / "shared-data.img"
    data.write_bytes(b"read-only data")
    return {"kernel": kernel, "initrd": initrd, "rootfs": rootfs, "data": data}


def make_spec(tmp_path: Path, files: dict[str, Path], name: str = "vm1", **kw) -> VMSpec:
    args = dict(
        vm_id=name, workdir=tmp_path / "vms" / name, kernel=files["kernel"],
        initrd=files["initrd"], vcpus=2, memory_mib=MEM_MIB, tap="tap0",
        boot_args="console=ttyS0 tsc_early_khz=2596000 tsc=reliable root=/dev/vda rw",
        drives=(Drive("rootfs", files["rootfs"]), Drive("data", files["data"], read_only=True)),
    )
    args.update(kw)
    return VMSpec(**args)


@pytest.fixture
async def vms() -> AsyncIterator[list[FirecrackerVM]]:
    """VMs a test started; stopped at teardown even when the test failed."""
    started: list[FirecrackerVM] = []
    yield started
    for vm in started:
        if vm.is_alive():
            await vm.stop(timeout=1)


async def boot(runtime: FirecrackerRuntime, spec: VMSpec, vms: list) -> FirecrackerVM:
    vm = await runtime.boot(spec)
    vms.append(vm)
    return vm


def checked(fake: FakeFirecracker, pid: int) -> list[tuple[str, str, object]]:
    """The requests process ``pid`` served, each validated against the v1.16.1 schema."""
    requests = fake.requests(pid)
    for method, path, body in requests:
        check_request(method, path, body)
    return requests


def runtime(**kw) -> FirecrackerRuntime:
    return FirecrackerRuntime(accel=KVM, **kw)


# -- boot -----------------------------------------------------------------------------------


async def test_boot_sends_the_documented_fresh_boot_sequence_with_schema_valid_bodies(
        tmp_path, fake, host_files, vms) -> None:
    spec = make_spec(tmp_path, host_files)
    vm = await boot(runtime(), spec, vms)
    assert checked(fake, vm.pid) == [
        ("GET", "/version", None),
        ("PUT", "/serial", {"serial_out_path": "console.log"}),
        ("PUT", "/machine-config", {"vcpu_count": 2, "mem_size_mib": MEM_MIB, "smt": False,
                                    "track_dirty_pages": True}),
        ("PUT", "/boot-source", {"kernel_image_path": "kernel", "initrd_path": "initrd",
                                 "boot_args": "console=ttyS0 root=/dev/vda rw reboot=k"}),
        ("PUT", "/drives/rootfs", {"drive_id": "rootfs", "path_on_host": "rootfs.raw",
                                   "is_root_device": True, "is_read_only": False}),
        ("PUT", "/drives/data", {"drive_id": "data", "path_on_host": "data.raw",
                                 "is_root_device": False, "is_read_only": True}),
        ("PUT", "/network-interfaces/eth0", {"iface_id": "eth0", "host_dev_name": "tap0",
                                             "guest_mac": GUEST_MAC}),
        ("PUT", "/entropy", {}),
        ("PUT", "/actions", {"action_type": "InstanceStart"}),
    ]
    assert await vm.status() == "Running"
    assert set(vm.boot_timings) >= {"api_ready", "configured", "qmp_ready"}


async def test_logger_and_metrics_come_first_when_configured(tmp_path, fake, host_files,
                                                             vms) -> None:
    vm = await boot(runtime(log_level="Info", metrics=True), make_spec(tmp_path, host_files),
                    vms)
    requests = checked(fake, vm.pid)
    assert requests[1:3] == [
        ("PUT", "/logger", {"level": "Info", "show_level": True, "show_log_origin": False}),
        ("PUT", "/metrics", {"metrics_path": "metrics.json"}),
    ]


async def test_no_tap_means_no_network_interface(tmp_path, fake, host_files, vms) -> None:
    vm = await boot(runtime(), make_spec(tmp_path, host_files, tap=None), vms)
    assert not [p for _, p, _ in fake.requests(vm.pid) if p.startswith("/network-interfaces")]


async def test_the_vmm_runs_in_the_workdir_in_its_own_process_group_with_files_there(
        tmp_path, fake, host_files, vms) -> None:
    spec = make_spec(tmp_path, host_files)
    vm = await boot(runtime(), spec, vms)
    start = fake.starts()[-1]
    assert start["pid"] == vm.pid
    assert start["cwd"] == str(spec.workdir.resolve())
    assert start["pgid"] == start["sid"] == vm.pid  # own session, so own process group
    assert start["argv"][-2:] == ["--api-sock", "firecracker.sock"]
    assert (spec.workdir / wd.PIDFILE).read_text().strip() == str(vm.pid)
    assert (spec.workdir / "firecracker.sock").is_socket()
    assert "listening" in (spec.workdir / wd.VMM_LOG).read_text()
    assert "guest started" in (spec.workdir / wd.CONSOLE).read_text()  # via PUT /serial
    assert (spec.workdir / "rootfs.raw").resolve() == host_files["rootfs"].resolve()


async def test_a_workdir_deeper_than_sun_path_still_boots(tmp_path, fake, host_files,
                                                          vms) -> None:
    deep = tmp_path / ("x" * 80) / ("y" * 40) / "vm1"
    vm = await boot(runtime(), make_spec(tmp_path, host_files, workdir=deep), vms)
    assert len(str(deep / "firecracker.sock")) > 108
    assert await vm.status() == "Running"


def test_the_argv_enters_the_slots_netns_with_nsenter() -> None:
    assert fcd.build_argv("/usr/bin/firecracker", "aenv-slot3") == [
        "nsenter", "--net=/run/netns/aenv-slot3", "--",
        "/usr/bin/firecracker", "--api-sock", "firecracker.sock"]
    assert fcd.build_argv("fc", None) == ["fc", "--api-sock", "firecracker.sock"]


def test_boot_args_drop_tcg_clock_pinning_and_add_keyboard_reboot() -> None:
    assert fcd.boot_args("console=ttyS0 tsc_early_khz=2596000 tsc=reliable panic=1") == \
        "console=ttyS0 panic=1 reboot=k"
    assert fcd.boot_args("console=ttyS0 reboot=t") == "console=ttyS0 reboot=t"


# -- refusals before anything starts --------------------------------------------------------


async def test_a_qcow2_drive_is_refused_before_anything_starts(tmp_path, fake,
                                                               host_files) -> None:
    spec = make_spec(tmp_path, host_files,
                     drives=(Drive("rootfs", host_files["rootfs"], format="qcow2"),))
    with pytest.raises(NotSupportedError, match="raw files only"):
        await runtime().boot(spec)
    assert fake.starts() == [] and not spec.workdir.exists()


async def test_a_file_backed_guest_ram_is_refused(tmp_path, fake, host_files) -> None:
    spec = make_spec(tmp_path, host_files, memory_file=tmp_path / "ram")
    with pytest.raises(NotSupportedError, match="memory_file"):
        await runtime().boot(spec)
    assert fake.starts() == []


async def test_a_compressed_kernel_is_refused(tmp_path, fake, host_files) -> None:
    host_files["kernel"].write_bytes(b"MZ\x00\x00bzImage")
    with pytest.raises(BootError, match="uncompressed vmlinux"):
        await runtime().boot(make_spec(tmp_path, host_files))
    assert fake.starts() == []


async def test_a_host_without_hardware_kvm_is_refused_before_spawning(tmp_path, fake,
                                                                     host_files) -> None:
    pvm = FirecrackerRuntime(accel=AccelChoice("tcg", "/dev/kvm is kvm_pvm (PVM)"))
    with pytest.raises(BootError, match=r"needs hardware KVM: /dev/kvm is kvm_pvm"):
        await pvm.boot(make_spec(tmp_path, host_files))
    assert fake.starts() == []


async def test_no_binary_on_path_is_a_boot_error(tmp_path, host_files, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(BootError, match="no firecracker binary"):
        await runtime().boot(make_spec(tmp_path, host_files))


# -- errors ---------------------------------------------------------------------------------


async def test_a_400_during_boot_is_a_boot_error_with_the_fault_message_and_no_process(
        tmp_path, fake, host_files, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_FC_FAULT", "PUT /drives/rootfs")
    monkeypatch.setenv("FAKE_FC_FAULT_MESSAGE", "Unable to open block device: EACCES")
    with pytest.raises(BootError) as err:
        await runtime().boot(make_spec(tmp_path, host_files))
    cause = err.value.__cause__
    assert isinstance(cause, fc.FirecrackerAPIError) and cause.status == 400
    assert cause.fault_message == "Unable to open block device: EACCES"
    assert "Unable to open block device: EACCES" in str(err.value)
    assert "listening" in err.value.vmm_log_tail
    pid = fake.starts()[-1]["pid"]
    assert ("PUT", "/actions", {"action_type": "InstanceStart"}) not in fake.requests(pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_a_400_after_boot_raises_control_error_with_the_fault_message(
        tmp_path, fake, host_files, vms, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_FC_FAULT", "PATCH /vm")
    monkeypatch.setenv("FAKE_FC_FAULT_MESSAGE", "Failed to pause the vCPUs.")
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    with pytest.raises(ControlError) as err:
        await vm.pause()
    assert isinstance(err.value, fc.FirecrackerAPIError)
    assert err.value.fault_message == "Failed to pause the vCPUs." and err.value.vm_id == "vm1"
    assert vm.is_alive()


async def test_a_version_older_than_1_14_is_refused_after_asking_it(
        tmp_path, fake, host_files, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_FC_VERSION", "1.12.0")
    with pytest.raises(BootError, match=r"1\.12\.0 is too old"):
        await runtime().boot(make_spec(tmp_path, host_files))
    assert fake.requests(fake.starts()[-1]["pid"]) == [("GET", "/version", None)]


async def test_calls_to_a_dead_vmm_raise_vm_exited(tmp_path, fake, host_files, vms) -> None:
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    os.kill(vm.pid, signal.SIGKILL)
    await vm.wait()
    with pytest.raises(VMExitedError):
        await vm.pause()


# -- pause, resume, stop, attach ------------------------------------------------------------


async def test_pause_and_resume_patch_the_vm_state(tmp_path, fake, host_files, vms) -> None:
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    await vm.pause()
    assert await vm.status() == "Paused"
    await vm.resume()
    assert await vm.status() == "Running"
    calls = [r for r in checked(fake, vm.pid) if r[1] == "/vm"]
    assert calls == [("PATCH", "/vm", {"state": "Paused"}), ("PATCH", "/vm", {"state": "Resumed"})]


async def test_stop_sends_sigterm_to_the_process_group(tmp_path, fake, host_files) -> None:
    vm = await runtime().boot(make_spec(tmp_path, host_files))
    t = time.monotonic()
    await vm.stop(timeout=5)
    assert time.monotonic() - t < 4  # the fake exits on SIGTERM: no SIGKILL wait
    assert not vm.is_alive()
    assert [e["signal"] for e in fake.entries(vm.pid) if e.get("event") == "signal"] == ["SIGTERM"]
    assert "SendCtrlAltDel" not in str(fake.requests(vm.pid))


async def test_stop_kills_a_vmm_that_ignores_sigterm(tmp_path, fake, host_files,
                                                     monkeypatch) -> None:
    monkeypatch.setenv("FAKE_FC_IGNORE_TERM", "1")
    vm = await runtime().boot(make_spec(tmp_path, host_files))
    await vm.stop(timeout=0.5)
    assert not vm.is_alive()
    assert [e for e in fake.entries(vm.pid) if e.get("event") == "signal"]  # it saw SIGTERM


async def test_attach_finds_the_live_vmm_by_pidfile_and_drives_it(tmp_path, fake, host_files,
                                                                   vms) -> None:
    spec = make_spec(tmp_path, host_files)
    first = await boot(runtime(), spec, vms)
    await first.detach()
    again = await get_runtime("firecracker").attach(spec.workdir)
    assert again.pid == first.pid and again.vm_id == "vm1"
    await again.pause()
    assert await again.status() == "Paused"
    assert fake.requests(first.pid)[-2:] == [("PATCH", "/vm", {"state": "Paused"}),
                                             ("GET", "/", None)]
    await again.stop(timeout=2)
    await first.wait()  # reap our child


async def test_attach_refuses_a_pid_that_does_not_run_in_the_workdir(tmp_path, fake,
                                                                      host_files, vms) -> None:
    spec = make_spec(tmp_path, host_files)
    await boot(runtime(), spec, vms)
    (spec.workdir / wd.PIDFILE).write_text(f"{os.getpid()}\n")  # a live pid, not the VMM
    with pytest.raises(AttachError, match="not"):
        await runtime().attach(spec.workdir)


# -- snapshot and restore -------------------------------------------------------------------


async def snapshot_of(vm: FirecrackerVM, directory: Path, **kw) -> snapshots.Manifest:
    await vm.snapshot(directory, **kw)
    return snapshots.read_manifest(directory)


def no_reflink(src: Path, dest: Path) -> None:
    raise OSError(95, "Operation not supported")


@pytest.fixture
def exact_extents(tmp_path: Path) -> None:
    """Diff layers are only taken where sparse files report page-exact data extents."""
    if not fcsnap.sparse_extents_exact(tmp_path):
        pytest.skip(f"{tmp_path} does not report page-exact data extents (SEEK_DATA)")


async def test_snapshot_of_a_running_vm_pauses_creates_with_relative_paths_and_resumes(
        tmp_path, fake, host_files, vms) -> None:
    spec = make_spec(tmp_path, host_files)
    vm = await boot(runtime(), spec, vms)
    snap = tmp_path / "snaps" / "s1"
    booted = len(fake.requests(vm.pid))
    info = await vm.snapshot(snap)
    after_boot = checked(fake, vm.pid)[booted:]
    assert [(m, p) for m, p, _ in after_boot] == [
        ("GET", "/"), ("PATCH", "/vm"), ("PUT", "/snapshot/create"), ("PATCH", "/vm")]
    assert after_boot[1][2] == {"state": "Paused"} and after_boot[3][2] == {"state": "Resumed"}
    body = after_boot[2][2]
    assert body["snapshot_type"] == "Full"  # no parent yet: incremental falls back to Full
    for key, name in (("snapshot_path", "vmstate"), ("mem_file_path", "memory")):
        assert not os.path.isabs(body[key])
        target = Path(os.path.normpath(spec.workdir / body[key]))
        assert target.name == name and target.parent.name.startswith(".s1.partial-")
    assert await vm.status() == "Running"
    assert (info.directory, info.parent, info.memory_layers, info.compacted) == \
        (snap, None, 1, False)
    assert 0 < info.freeze_s <= info.total_s and info.memory_bytes > 0
    manifest = snapshots.read_manifest(snap)
    assert manifest.driver == "firecracker" and manifest.diff_depth == 0
    assert manifest.memory_size == MEM_MIB << 20
    assert manifest.vm["firecracker_version"] == "1.16.1"
    root, data = manifest.drive("rootfs"), manifest.drive("data")
    assert root.file == "rootfs.raw" and (snap / "rootfs.raw").read_bytes()[:7] == b"root-v1"
    assert data.read_only and data.path == host_files["data"].resolve()


async def test_snapshot_of_a_paused_vm_leaves_it_paused(tmp_path, fake, host_files,
                                                        vms) -> None:
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    await vm.pause()
    await vm.snapshot(tmp_path / "snaps" / "s1")
    assert [p for _, p, _ in fake.requests(vm.pid)][-3:] == ["/vm", "/", "/snapshot/create"]
    assert await vm.status() == "Paused"


async def test_snapshot_with_stop_ends_the_vmm_after_the_capture(tmp_path, fake, host_files,
                                                                 vms) -> None:
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    info = await vm.snapshot(tmp_path / "snaps" / "s1", stop=True)
    assert not vm.is_alive()
    assert info.freeze_s >= info.phases["finish"] > 0  # frozen until the VMM is gone
    requests = fake.requests(vm.pid)
    assert requests[-1][:2] == ("PUT", "/snapshot/create")  # never resumed
    assert [e["signal"] for e in fake.entries(vm.pid) if e.get("event") == "signal"] == ["SIGTERM"]
    snapshots.read_manifest(tmp_path / "snaps" / "s1")


async def test_a_failed_create_is_a_snapshot_error_and_the_vm_runs_on(
        tmp_path, fake, host_files, vms, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_FC_FAULT", "PUT /snapshot/create")
    monkeypatch.setenv("FAKE_FC_FAULT_MESSAGE", "No space left on device (os error 28)")
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    with pytest.raises(SnapshotError, match="os error 28") as err:
        await vm.snapshot(tmp_path / "snaps" / "s1")
    assert isinstance(err.value.__cause__, fc.FirecrackerAPIError)
    assert err.value.vm_lost is False
    assert await vm.status() == "Running"
    assert not (tmp_path / "snaps" / "s1").exists()
    assert not list((tmp_path / "snaps").glob(".s1.partial-*"))


async def dirty_then_pause(vm: FirecrackerVM) -> None:
    await vm.resume()  # the fake guest writes page 1 and page 10+n on every resume
    await vm.pause()


async def test_incremental_snapshot_without_reflink_is_a_diff_layer_on_its_parent(
        tmp_path, fake, host_files, vms, monkeypatch, exact_extents) -> None:
    monkeypatch.setattr(fcsnap, "reflink", no_reflink)
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    await vm.pause()
    s1 = tmp_path / "snaps" / "s1"
    await snapshot_of(vm, s1)
    await dirty_then_pause(vm)
    s2 = tmp_path / "snaps" / "s2"
    info = await vm.snapshot(s2)
    m2 = snapshots.read_manifest(s2)
    assert checked(fake, vm.pid)[-1][2]["snapshot_type"] == "Diff"
    assert [la.directory for la in m2.layers] == [s1, s2] and m2.parent == s1
    assert snapshots.read_runs(s2 / snapshots.MEMORY_RUNS) == [(1, 1), (11, 1)]
    assert (info.parent, info.memory_layers, info.memory_bytes) == (s1, 2, 2 * PAGE)
    # the same moment as a Full snapshot: the stack must merge to exactly its memory
    s3 = tmp_path / "snaps" / "s3"
    await snapshot_of(vm, s3, incremental=False)
    assert checked(fake, vm.pid)[-1][2]["snapshot_type"] == "Full"
    restored = await runtime().restore(s2, RestoreOverrides("vm2", tmp_path / "vms" / "vm2"))
    vms.append(restored)
    merged = tmp_path / "vms" / "vm2" / "memory"
    assert merged.read_bytes() == (s3 / "memory").read_bytes()
    load = fake.requests(restored.pid)[-1]
    assert load[2]["mem_backend"] == {"backend_type": "File", "backend_path": "memory"}


async def test_incremental_snapshot_with_reflink_merges_the_diff_into_a_clone(
        tmp_path, fake, host_files, vms, monkeypatch) -> None:
    # A plain copy stands in for FICLONE (no reflink filesystem here): the API contract
    # is the same, a Diff written into an existing memory file of the guest's size.
    monkeypatch.setattr(fcsnap, "reflink", lambda s, d: snapshots.copy_sparse(s, d))
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    await vm.pause()
    await snapshot_of(vm, tmp_path / "snaps" / "s1")
    await dirty_then_pause(vm)
    m2 = await snapshot_of(vm, tmp_path / "snaps" / "s2")
    assert checked(fake, vm.pid)[-1][2]["snapshot_type"] == "Diff"
    assert m2.diff_depth == 0 and m2.layers[0].kind == "full"
    await snapshot_of(vm, tmp_path / "snaps" / "s3", incremental=False)
    assert (tmp_path / "snaps" / "s2" / "memory").read_bytes() == \
        (tmp_path / "snaps" / "s3" / "memory").read_bytes()


async def test_incremental_is_full_without_dirty_page_tracking(tmp_path, fake, host_files,
                                                               vms) -> None:
    vm = await boot(runtime(track_dirty_pages=False), make_spec(tmp_path, host_files), vms)
    assert fake.requests(vm.pid)[2][2]["track_dirty_pages"] is False
    await vm.pause()
    await snapshot_of(vm, tmp_path / "snaps" / "s1")
    await dirty_then_pause(vm)
    m2 = await snapshot_of(vm, tmp_path / "snaps" / "s2")
    assert checked(fake, vm.pid)[-1][2]["snapshot_type"] == "Full" and m2.diff_depth == 0


async def test_restore_loads_the_snapshot_in_a_new_process_with_the_new_tap(
        tmp_path, fake, host_files, vms) -> None:
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    snap = tmp_path / "snaps" / "s1"
    await vm.snapshot(snap, stop=True)
    workdir = tmp_path / "vms" / "clone1"
    console = tmp_path / "logs" / "clone1.console"
    clone = await runtime().restore(snap, RestoreOverrides("clone1", workdir, tap="tap7",
                                                           console_log=console))
    vms.append(clone)
    assert clone.pid != vm.pid
    requests = checked(fake, clone.pid)
    assert [r[:2] for r in requests] == [("GET", "/version"), ("PUT", "/serial"),
                                         ("PUT", "/snapshot/load")]
    body = requests[-1][2]
    assert body == {
        "snapshot_path": os.path.relpath(snap / "vmstate", workdir),
        "mem_backend": {"backend_type": "File",
                        "backend_path": os.path.relpath(snap / "memory", workdir)},
        "track_dirty_pages": True,
        "resume_vm": True,
        "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap7"}],
    }
    assert await clone.status() == "Running"
    # the snapshot's own disk is copied, never used in place; shared images are linked
    assert not (workdir / "rootfs.raw").is_symlink()
    assert (workdir / "rootfs.raw").read_bytes()[:7] == b"root-v1"
    assert (workdir / "data.raw").resolve() == host_files["data"].resolve()
    assert (workdir / wd.CONSOLE).resolve() == console.resolve()
    assert clone.machine.network is not None and clone.machine.network.host_dev_name == "tap7"


async def test_restore_uses_a_drive_override_in_place_of_the_snapshots_copy(
        tmp_path, fake, host_files, vms) -> None:
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    snap = tmp_path / "snaps" / "s1"
    await vm.snapshot(snap)
    mine = tmp_path / "my-disk.raw"
    mine.write_bytes(b"mine")
    workdir = tmp_path / "vms" / "clone1"
    clone = await runtime().restore(snap, RestoreOverrides("clone1", workdir,
                                                           drives={"rootfs": mine}))
    vms.append(clone)
    assert (workdir / "rootfs.raw").resolve() == mine.resolve()
    assert "network_overrides" not in fake.requests(clone.pid)[-1][2]


async def test_an_incremental_snapshot_of_a_restored_vm_diffs_against_what_it_loaded(
        tmp_path, fake, host_files, vms, monkeypatch, exact_extents) -> None:
    monkeypatch.setattr(fcsnap, "reflink", no_reflink)
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    s1 = tmp_path / "snaps" / "s1"
    await vm.snapshot(s1)
    clone = await runtime().restore(s1, RestoreOverrides("c", tmp_path / "vms" / "c"))
    vms.append(clone)
    assert clone.memory_parent == s1
    m2 = await snapshot_of(clone, tmp_path / "snaps" / "s2")
    assert checked(fake, clone.pid)[-2][2]["snapshot_type"] == "Diff"  # then Resumed
    assert [la.directory for la in m2.layers] == [s1, tmp_path / "snaps" / "s2"]


async def test_a_failed_load_is_a_snapshot_error_with_the_fault_and_no_process(
        tmp_path, fake, host_files, vms, monkeypatch) -> None:
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    snap = tmp_path / "snaps" / "s1"
    await vm.snapshot(snap)
    monkeypatch.setenv("FAKE_FC_FAULT", "PUT /snapshot/load")
    monkeypatch.setenv("FAKE_FC_FAULT_MESSAGE", "Snapshot version mismatch")
    with pytest.raises(SnapshotError, match="Snapshot version mismatch") as err:
        await runtime().restore(snap, RestoreOverrides("c", tmp_path / "vms" / "c"))
    assert isinstance(err.value.__cause__, fc.FirecrackerAPIError)
    assert "listening" in err.value.vmm_log_tail
    pid = fake.starts()[-1]["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_restore_into_an_existing_workdir_is_refused(tmp_path, fake, host_files,
                                                           vms) -> None:
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    snap = tmp_path / "snaps" / "s1"
    await vm.snapshot(snap)
    with pytest.raises(SnapshotError, match="exists"):
        await runtime().restore(snap, RestoreOverrides("again", vm.workdir))
    assert len(fake.starts()) == 1


async def test_restore_refuses_a_snapshot_of_another_driver(tmp_path, fake) -> None:
    snap = tmp_path / "qemu-snap"
    staging = snapshots.begin(snap)
    (staging / "vmstate").write_bytes(b"qemu")
    with open(staging / "memory", "wb") as f:
        f.truncate(1 << 20)
    snapshots.commit(staging, snap, snapshots.Manifest(
        driver="qemu", vm={}, memory_size=1 << 20,
        layers=(snapshots.MemoryLayer(snap, "full", 0),), drives=()))
    with pytest.raises(SnapshotError, match="qemu driver"):
        await runtime().restore(snap, RestoreOverrides("c", tmp_path / "c"))
    assert fake.starts() == []


async def test_restore_refuses_a_machine_record_of_an_unknown_version(tmp_path, fake, host_files,
                                                                   vms) -> None:
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    snap = tmp_path / "snaps" / "s1"
    await vm.snapshot(snap)
    raw = json.loads((snap / snapshots.MANIFEST).read_text())
    assert raw["vm"]["version"] == FirecrackerMachine.VERSION
    raw["vm"]["version"] = FirecrackerMachine.VERSION + 1
    (snap / snapshots.MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(MachineRecordError, match="version 2; this aenv reads version 1"):
        await runtime().restore(snap, RestoreOverrides("c", tmp_path / "vms" / "c"))
    assert len(fake.starts()) == 1


async def test_a_machine_record_without_a_version_still_restores_and_attaches(
        tmp_path, fake, host_files, vms) -> None:
    """Records written before they had a version are version 1."""
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    snap = tmp_path / "snaps" / "s1"
    await vm.snapshot(snap)
    for path, key in ((snap / snapshots.MANIFEST, "vm"), (vm.workdir / wd.MANIFEST, "machine")):
        raw = json.loads(path.read_text())
        del raw[key]["version"]
        path.write_text(json.dumps(raw))
    clone = await runtime().restore(snap, RestoreOverrides("c", tmp_path / "vms" / "c"))
    vms.append(clone)
    assert clone.machine == vm.machine
    await vm.detach()
    again = await runtime().attach(vm.workdir)
    assert again.machine == vm.machine
    await again.stop(timeout=2)
    await vm.wait()  # reap our child


# -- doctor ---------------------------------------------------------------------------------


def test_doctor_rows_name_the_binary_the_kvm_verdict_and_what_is_missing(fake) -> None:
    from aenv.runtime.kvm import host_accel

    rows = dict(fcd.doctor_checks())
    assert rows["firecracker"].startswith(str(fake.bin_dir / "firecracker"))
    assert rows["firecracker"].endswith("1.16.1")
    choice = host_accel()
    if choice.accel == "kvm":
        assert rows["firecracker kvm"].startswith("usable")
        assert rows["firecracker runtime"] == "ready"
    else:
        assert rows["firecracker kvm"] == f"unusable: {choice.reason}"
        assert rows["firecracker runtime"] == "missing hardware KVM"


def test_doctor_says_the_binary_is_missing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    rows = dict(fcd.doctor_checks())
    assert rows["firecracker"] == "not found on PATH"
    assert "a firecracker binary (v1.14 or newer) on PATH" in rows["firecracker runtime"]


def test_get_runtime_returns_the_firecracker_driver() -> None:
    assert get_runtime("firecracker").name == "firecracker"


# -- pre-started VMMs (aenv.runtime.vmm_pool) -------------------------------------------------


async def test_a_prestarted_firecracker_waits_with_its_api_up_and_activate_only_loads(
        tmp_path, fake, host_files, vms) -> None:
    """What the VMM pool relies on, as far as the fake can show it: ``prestart`` spawns
    Firecracker, its API socket answers and its serial is set, and no snapshot is loaded;
    ``activate`` sends ``PUT /snapshot/load`` alone; ``discard`` leaves no process. It
    proves the request sequence, not that a guest resumes (no Firecracker binary here)."""
    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    snap = tmp_path / "snaps" / "s1"
    await vm.snapshot(snap, stop=True)
    rt = runtime()
    pre = await rt.prestart(snap, RestoreOverrides("p1", tmp_path / "vms" / "p1", tap="tap7"))
    assert pre.is_alive() and pre.workdir == tmp_path / "vms" / "p1"
    assert [r[:2] for r in checked(fake, pre.vm.pid)] == [("GET", "/version"),
                                                         ("PUT", "/serial")]
    clone = await rt.activate(pre)
    vms.append(clone)
    requests = checked(fake, clone.pid)
    assert [r[:2] for r in requests][2:] == [("PUT", "/snapshot/load")]
    assert requests[-1][2]["resume_vm"] is True
    assert requests[-1][2]["network_overrides"] == [{"iface_id": "eth0",
                                                     "host_dev_name": "tap7"}]
    assert await clone.status() == "Running" and "activate" in clone.boot_timings
    unused = await rt.prestart(snap, RestoreOverrides("p2", tmp_path / "vms" / "p2"))
    pid = unused.vm.pid
    await rt.discard(unused)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert ("PUT", "/snapshot/load") not in [r[:2] for r in fake.requests(pid)]


async def test_the_vmm_pool_hands_out_prestarted_firecrackers(tmp_path, fake, host_files,
                                                              vms) -> None:
    """``VMMPool`` over the Firecracker driver (the fake): a take returns a VMM that only
    needs its load; one killed with SIGKILL is discarded; close ends the rest."""
    from aenv.runtime.vmm_pool import VMMPool

    class Lease:
        netns = None

    released: list[object] = []

    async def acquire() -> Lease:
        return Lease()

    async def release(lease: object) -> None:
        released.append(lease)

    vm = await boot(runtime(), make_spec(tmp_path, host_files), vms)
    snap = tmp_path / "snaps" / "s1"
    await vm.snapshot(snap, stop=True)
    rt = runtime()
    pool = VMMPool(rt, tmp_path / "vms", size=2, memory_mb=4 * MEM_MIB,  # type: ignore[arg-type]
                   acquire=acquire, release=release, busy=lambda: False)
    try:
        first = await pool.fill_one(snap)
        second = await pool.fill_one(snap)
        os.kill(first.pre.vm.pid, signal.SIGKILL)
        await first.pre.vm.wait()
        taken = await pool.take(snap)
        assert taken is second and pool.stats["dead"] == 1
        clone = await rt.activate(taken.pre)
        vms.append(clone)
        assert await clone.status() == "Running"
        assert not first.workdir.exists() and len(released) == 1
        third = await pool.fill_one(snap)
    finally:
        await pool.close()
    with pytest.raises(ProcessLookupError):
        os.kill(third.pre.vm.pid, 0)
    assert len(released) == 2
