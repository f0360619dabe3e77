"""The Firecracker driver under the jailer, without a Firecracker binary or KVM.

What these tests prove: the jailer command line is the one docs/jailer.md (v1.16.1)
documents, built from the VM's uid, cgroup limits, netns and sizes; the jail root holds
exactly what Firecracker opens, as hard links with the owners and modes an unprivileged
Firecracker needs (the VM's own disk and console given to its uid, shared kernel and images
linked untouched); every request path the driver sends resolves inside the jail; the VMM
runs as the VM's uid inside its real cgroup (this host's cgroupfs); snapshots written in
the jail come out root's; a restore links the snapshot's files into a new jail; a restarted
server re-attaches by the jail root's identity; stop releases cgroup and uid.

How: ``fake_jailer.py`` does what the jailer documentation says the jailer does, except the
mount namespace, pivot_root and mknod (its Firecracker is a Python script that needs the
host's interpreter): it chdirs into the root, drops to uid:gid and execs the copied
``fake_firecracker.py``, which then refuses any path leaving its cwd and opens every file
with the access a real Firecracker needs, as that uid. What they do not prove: that a real
jailer accepts these arguments (only its documentation was read) and that a guest boots.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from aenv.runtime import Drive, RestoreOverrides, VMLimits, VMSpec
from aenv.runtime import confine as cf
from aenv.runtime import firecracker_jail as fj
from aenv.runtime.firecracker import FirecrackerRuntime, FirecrackerVM
from aenv.runtime.kvm import AccelChoice
from aenv.runtime.vmm_process import NotOurProcessError, VMMProcess
from aenv.storage import snapshots
from tests.runtime.conftest import remove_cgroups

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the jailer runs as root")

HERE = Path(__file__).parent
KVM = AccelChoice("kvm", "test: pretend hardware KVM")
MEM_MIB = 32
PREFIX = "aenvfj"


@pytest.fixture
def world() -> Iterator[Path]:
    """A directory the jailed (unprivileged) fake can write its record to."""
    d = Path(tempfile.mkdtemp(prefix="aenv-fj-", dir="/tmp"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def binaries(world: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    bin_dir = world / "bin"
    bin_dir.mkdir()
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    fc_exe = bin_dir / "firecracker"
    fc_exe.write_text(f'#!/bin/sh\nexec {python} {HERE / "fake_firecracker.py"} "$@"\n')
    jailer = bin_dir / "jailer"
    jailer.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE / "fake_jailer.py"} "$@"\n')
    for exe in (fc_exe, jailer):
        exe.chmod(0o755)
    record = world / "fc-record.jsonl"
    record.touch()
    record.chmod(0o666)
    monkeypatch.setenv("FAKE_FC_RECORD", str(record))
    monkeypatch.setenv("FAKE_JAILER_RECORD", str(world / "jailer.jsonl"))
    return {"firecracker": fc_exe, "jailer": jailer, "record": record,
            "jailer_record": world / "jailer.jsonl"}


@pytest.fixture
def runtime(binaries, tmp_path) -> FirecrackerRuntime:
    conf = cf.Confinement(prefix=PREFIX, ids_dir=tmp_path / "ids", uid_base=0x7D00_0000,
                          uid_count=16)
    return FirecrackerRuntime(binary=str(binaries["firecracker"]),
                              jailer=str(binaries["jailer"]), accel=KVM, confinement=conf)


@pytest.fixture
def host_files(tmp_path: Path) -> dict[str, Path]:
    shared = tmp_path / "shared"
    shared.mkdir()
    kernel = shared / "vmlinux"
    kernel.write_bytes(b"\x7fELF" + b"\0" * 60)
    initrd = shared / "initrd.img"
    initrd.write_bytes(b"070701")
    data = shared / "data.img"
    data.write_bytes(b"read-only data")
    for f in (kernel, initrd, data):
        f.chmod(0o644)
    return {"kernel": kernel, "initrd": initrd, "data": data}


def make_spec(tmp_path: Path, files: dict[str, Path], name: str = "vm1") -> VMSpec:
    workdir = tmp_path / "vms" / name
    workdir.mkdir(parents=True)
    rootfs = workdir / "rootfs.raw"  # a sandbox disk lives in its working directory
    with open(rootfs, "wb") as f:
        f.write(b"root-v1")
        f.truncate(1 << 20)
    return VMSpec(vm_id=name, workdir=workdir, kernel=files["kernel"], initrd=files["initrd"],
                  vcpus=2, memory_mib=MEM_MIB, boot_args="console=ttyS0",
                  drives=(Drive("rootfs", rootfs), Drive("data", files["data"], read_only=True)),
                  limits=VMLimits(memory_bytes=96 << 20))


@pytest.fixture
async def vms(runtime) -> AsyncIterator[list[FirecrackerVM]]:
    started: list[FirecrackerVM] = []
    yield started
    for vm in started:
        if vm.is_alive():
            await vm.stop(timeout=1)
        await vm.stop(timeout=1)  # releases the jail of a VMM that died
    remove_cgroups(runtime.confinement.hierarchies(at_root=True))


def requests(record: Path, pid: int) -> list[dict]:
    return [e for e in map(json.loads, record.read_text().splitlines())
            if e.get("pid") == pid and "method" in e]


def status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text()
                .splitlines() if ":\t" in line)


def test_build_argv_is_the_documented_cli(tmp_path) -> None:
    jail = cf.Jail("vm-7", tmp_path, uid=0x70000005, gid=cf.VMM_GID, released=True)
    layout = fj.JailLayout.of(tmp_path / "vms" / "vm-7", "vm-7", "/usr/bin/firecracker")
    assert layout.root == tmp_path / "vms/vm-7/jail/firecracker/vm-7/root"
    argv = fj.build_argv(
        "/usr/bin/jailer", "/usr/bin/firecracker", "vm-7", jail, layout,
        netns=Path("/run/netns/aenv-ns-3"),
        cgroup=("2", "aenv-vms", ["memory.max=805306368", "cpu.max=225000 100000",
                                  "pids.max=176"]),
        rlimits=fj.resource_limits(512, 2 << 30), api_socket="firecracker.sock")
    assert argv == [
        "/usr/bin/jailer", "--id", "vm-7", "--exec-file", "/usr/bin/firecracker",
        "--uid", str(0x70000005), "--gid", str(cf.VMM_GID),
        "--chroot-base-dir", str(tmp_path / "vms/vm-7/jail"),
        "--netns", "/run/netns/aenv-ns-3",
        "--cgroup-version", "2", "--parent-cgroup", "aenv-vms",
        "--cgroup", "memory.max=805306368", "--cgroup", "cpu.max=225000 100000",
        "--cgroup", "pids.max=176",
        "--resource-limit", "no-file=2048", "--resource-limit", f"fsize={(2 << 30) + (64 << 20)}",
        "--", "--api-sock", "firecracker.sock"]


def test_cgroup_args_per_host_kind() -> None:
    from aenv.runtime.cgroups import Hierarchies, Hierarchy, Limits

    lim = Limits(memory_max=256 << 20, pids_max=176, cpu_quota_us=225_000, io_weight=200)
    v2 = Hierarchy(2, Path("/sys/fs/cgroup"), frozenset({"memory", "cpu", "pids", "io"}),
                   Path("/sys/fs/cgroup/system.slice/aenv.service"))
    (version, parent, files), used = fj.cgroup_args(
        Hierarchies([v2], prefix="aenv", parent=""), lim)
    assert (version, parent, used) == ("2", "aenv-vms", [v2])
    # memory.swap.max, memory.oom.group and the io weight are the driver's to write
    assert files == [f"memory.max={256 << 20}", "cpu.max=225000 100000", "pids.max=176"]
    mem = Hierarchy(1, Path("/sys/fs/cgroup/memory"), frozenset({"memory"}), Path("/x"))
    blk = Hierarchy(1, Path("/sys/fs/cgroup/blkio"), frozenset({"io"}), Path("/y"))
    (version, parent, files), used = fj.cgroup_args(
        Hierarchies([mem, blk], prefix="aenv", parent="machine"), lim)
    assert (version, parent, used) == ("1", "machine/aenv-vms", [mem])
    assert files == [f"memory.limit_in_bytes={256 << 20}"]


def test_ids_the_jailer_refuses_are_refused_first() -> None:
    from aenv.runtime.base import NotSupportedError

    for bad in ("vm_1", "a" * 65, "", "vm.1"):
        with pytest.raises(NotSupportedError):
            fj.check_id(bad)


async def test_a_jailed_boot(runtime, binaries, tmp_path, host_files, vms) -> None:
    spec = make_spec(tmp_path, host_files)
    vm = await runtime.boot(spec)
    vms.append(vm)
    jail = vm.jail
    root = spec.workdir / "jail/firecracker/vm1/root"

    # the command line
    (entry,) = map(json.loads, binaries["jailer_record"].read_text().splitlines())
    argv = entry["argv"][1:]
    assert argv[:argv.index("--chroot-base-dir")] == [
        "--id", "vm1", "--exec-file", str(binaries["firecracker"]), "--uid", str(jail.uid),
        "--gid", str(cf.VMM_GID)]
    assert argv[argv.index("--chroot-base-dir") + 1] == str(spec.workdir / "jail")
    v2 = argv[argv.index("--cgroup-version") + 1] == "2"
    assert f"memory.{'max' if v2 else 'limit_in_bytes'}={96 << 20}" in argv
    assert argv[-3:] == ["--", "--api-sock", "firecracker.sock"] and "--netns" not in argv

    # the VMM: the VM's uid and the VMM group, its cwd the jail root, in its cgroup
    st = status(vm.pid)
    assert st["Uid"].split() == [str(jail.uid)] * 4 and st["Gid"].split()[0] == str(cf.VMM_GID)
    assert os.readlink(f"/proc/{vm.pid}/cwd") == str(root)
    assert jail.cgroup is not None and jail.cgroup.contains(vm.pid)
    assert jail.cgroup.memory_stats()["limit"] == 96 << 20

    # the root: only what Firecracker opens (and what the jailer and Firecracker made)
    assert sorted(p.name for p in root.iterdir()) == [
        "console.log", "data.raw", "firecracker", "firecracker.sock", "initrd", "kernel",
        "rootfs.raw"]
    same = lambda a, b: os.stat(a).st_ino == os.stat(b).st_ino  # noqa: E731
    assert same(root / "rootfs.raw", spec.workdir / "rootfs.raw")
    assert same(root / "console.log", spec.workdir / "console.log")
    assert same(root / "kernel", host_files["kernel"]) and same(root / "data.raw",
                                                                 host_files["data"])
    for mine in ("rootfs.raw", "console.log"):
        s = os.stat(root / mine)
        assert (s.st_uid, stat.S_IMODE(s.st_mode)) == (jail.uid, 0o600), mine
    for shared in ("kernel", "initrd", "data.raw"):
        assert os.stat(root / shared).st_uid == 0, shared  # linked, never chowned
    assert os.stat(root).st_uid == jail.uid and not (root / "vm.json").exists()

    # every path the driver sent resolves inside the jail (the fake refuses others)
    bodies = [r["body"] for r in requests(binaries["record"], vm.pid) if r["body"]]
    assert {"kernel_image_path": "kernel", "initrd_path": "initrd",
            "boot_args": "console=ttyS0 reboot=k"} in bodies
    assert all(r["status"] == 204 for r in requests(binaries["record"], vm.pid)
               if r["method"] != "GET")

    # what the guest console gets is on the server's side too
    assert "guest started" in (spec.workdir / "console.log").read_text()


async def test_snapshot_restore_attach_and_stop_jailed(runtime, binaries, tmp_path,
                                                       host_files, vms) -> None:
    spec = make_spec(tmp_path, host_files)
    vm = await runtime.boot(spec)
    vms.append(vm)
    snap = tmp_path / "snaps" / "s1"
    snap.parent.mkdir()
    await vm.snapshot(snap)
    for name in (snapshots.DEVICE_STATE, snapshots.MEMORY):
        s = os.stat(snap / name)  # moved out of the jail, given back to root
        assert (s.st_uid, s.st_gid, stat.S_IMODE(s.st_mode)) == (0, cf.VMM_GID, 0o640), name
    assert not (spec.workdir / "jail/firecracker/vm1/root/snapshot").exists()

    workdir = tmp_path / "vms" / "vm2"
    clone = await runtime.restore(snap, RestoreOverrides("vm2", workdir))
    vms.append(clone)
    root = workdir / "jail/firecracker/vm2/root"
    assert clone.jail.uid not in (None, vm.jail.uid)
    load = [r for r in requests(binaries["record"], clone.pid)
            if r["path"] == "/snapshot/load"]
    assert load[0]["body"]["snapshot_path"] == snapshots.DEVICE_STATE
    assert load[0]["body"]["mem_backend"]["backend_path"] == snapshots.MEMORY
    assert os.stat(root / snapshots.MEMORY).st_ino == os.stat(snap / snapshots.MEMORY).st_ino
    assert await clone.status() == "Running"

    # a server restart: found again by its jail root, not by a cwd path
    await clone.detach()
    again = await runtime.attach(workdir)
    vms.append(again)
    assert again.pid == clone.pid and again.jail == clone.jail
    with pytest.raises(NotOurProcessError):
        VMMProcess.adopt(clone.pid, workdir, jail_root=spec.workdir)
    cg, uid = again.jail.cgroup, again.jail.uid
    await again.stop(timeout=1)
    assert not cg.exists() and not (runtime.confinement.ids_dir / str(uid)).exists()


async def test_without_a_jailer_firecracker_runs_as_before(binaries, tmp_path, host_files,
                                                           monkeypatch) -> None:
    monkeypatch.setenv("PATH", f"{binaries['firecracker'].parent}:/usr/bin:/bin")
    binaries["jailer"].unlink()
    rt = FirecrackerRuntime(binary=str(binaries["firecracker"]), accel=KVM)
    assert rt.jailer_binary() is None
    vm = await rt.boot(make_spec(tmp_path, host_files))
    try:
        assert status(vm.pid)["Uid"].split()[0] == "0" and vm.jail.released
        assert not (vm.workdir / "jail").exists()
    finally:
        await vm.stop(timeout=1)
