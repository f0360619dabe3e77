"""Per-VM cgroups (``aenv.runtime.cgroups``): where they go, what is written, and — on this
host's real cgroup filesystem — that a process spawned through the join wrapper is inside
before it execs, that kill and remove work, and that the start-up sweep spares what it must.

Parsing and the limit files are checked against synthetic ``/proc/self/mountinfo`` and
``/proc/self/cgroup`` texts of the three host kinds (pure v2, hybrid, v1). The real-kernel
tests need root and use whatever this host mounts: on a hybrid host (v1 controllers, a
controller-less v2 ``unified`` tree) the limits are exercised in v1 and the v2 core
(placement, ``cgroup.procs``, ``cgroup.kill``, removal) in the unified tree without
controllers; the v2 limit files themselves are checked by name and value only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from aenv.runtime.cgroups import (
    CgroupError,
    Hierarchies,
    Hierarchy,
    Limits,
    VMCgroup,
    sweep,
)
from aenv.runtime.confine import Jail
from tests.runtime.conftest import remove_cgroups

LIMITS = Limits(memory_max=768 << 20, pids_max=160, cpu_quota_us=125_000, io_weight=200)

V2_MOUNTINFO = """\
24 30 0:22 / /sys/fs/cgroup rw,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""
HYBRID_MOUNTINFO = """\
25 30 0:23 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:24 / /sys/fs/cgroup/unified rw,relatime shared:10 - cgroup2 cgroup2 rw
27 25 0:25 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:11 - cgroup cgroup rw,cpu,cpuacct
28 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory
29 25 0:27 / /sys/fs/cgroup/pids rw,relatime shared:13 - cgroup cgroup rw,pids
30 25 0:28 / /sys/fs/cgroup/blkio rw,relatime shared:14 - cgroup cgroup rw,blkio
"""
HYBRID_CGROUP = """\
12:pids:/system.slice/aenv.service
8:memory:/system.slice/aenv.service
4:cpu,cpuacct:/system.slice/aenv.service
3:blkio:/system.slice
1:name=systemd:/system.slice/aenv.service
0::/system.slice/aenv.service
"""


def discover(tmp_path: Path, mountinfo: str, cgroup: str, **kw) -> Hierarchies:
    (tmp_path / "mountinfo").write_text(mountinfo)
    (tmp_path / "cgroup").write_text(cgroup)
    return Hierarchies.discover(prefix="aenv", mountinfo=str(tmp_path / "mountinfo"),
                                cgroup_file=str(tmp_path / "cgroup"), **kw)


# -- where the cgroups go ---------------------------------------------------------------------


def test_pure_v2_puts_vms_in_a_tree_at_the_root_not_under_the_server(tmp_path,
                                                                   monkeypatch) -> None:
    """The server's own cgroup holds the server, so v2 forbids controllers for children
    there: the tree is a sibling at the root."""
    fake_root = tmp_path / "cg"
    fake_root.mkdir()
    (fake_root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    h = discover(tmp_path, V2_MOUNTINFO.replace("/sys/fs/cgroup", str(fake_root)),
                 "0::/system.slice/aenv.service\n")
    [v2] = h.hierarchies
    assert v2.version == 2 and v2.controllers == {"memory", "cpu", "pids", "io"}
    assert v2.own == fake_root / "system.slice/aenv.service"
    assert h.parent_dirs() == [fake_root / "aenv-vms"]


def test_hybrid_host_uses_v1_for_each_controller_under_the_servers_own_cgroup(
        tmp_path) -> None:
    h = discover(tmp_path, HYBRID_MOUNTINFO, HYBRID_CGROUP)
    by_controller = {c: x for x in h.hierarchies for c in x.controllers}
    assert set(by_controller) == {"memory", "cpu", "pids", "io"}
    assert all(x.version == 1 for x in h.hierarchies)
    assert by_controller["cpu"].mount == Path("/sys/fs/cgroup/cpu,cpuacct")
    assert by_controller["io"].own == Path("/sys/fs/cgroup/blkio/system.slice")
    assert Path("/sys/fs/cgroup/memory/system.slice/aenv.service/aenv-vms") in h.parent_dirs()


def test_an_explicit_parent_is_relative_to_each_hierarchy_root(tmp_path) -> None:
    h = discover(tmp_path, HYBRID_MOUNTINFO, HYBRID_CGROUP, parent="machine.slice/aenv")
    assert Path("/sys/fs/cgroup/pids/machine.slice/aenv/aenv-vms") in h.parent_dirs()
    with pytest.raises(ValueError):
        Hierarchies([], prefix="aenv", parent="../escape")
    with pytest.raises(ValueError):
        Hierarchies([], prefix="aenv", parent="/abs")


# -- what is written --------------------------------------------------------------------------


def test_v2_limit_files() -> None:
    h = Hierarchy(2, Path("/x"), frozenset({"memory", "cpu", "pids", "io"}), Path("/x"))
    assert dict(h.limit_files(LIMITS)) == {
        "memory.max": str(768 << 20), "memory.swap.max": "0", "memory.oom.group": "1",
        "cpu.max": "125000 100000", "pids.max": "160", "io.weight": "default 200",
        "io.bfq.weight": "200",
    }


def test_v1_limit_files_in_the_order_the_kernel_needs() -> None:
    memory = Hierarchy(1, Path("/m"), frozenset({"memory"}), Path("/m"))
    cpu = Hierarchy(1, Path("/c"), frozenset({"cpu"}), Path("/c"))
    io = Hierarchy(1, Path("/b"), frozenset({"io"}), Path("/b"))
    # memsw may not go below the memory limit, so the limit is written first
    assert memory.limit_files(LIMITS) == [("memory.limit_in_bytes", str(768 << 20)),
                                          ("memory.memsw.limit_in_bytes", str(768 << 20))]
    assert cpu.limit_files(LIMITS) == [("cpu.cfs_period_us", "100000"),
                                       ("cpu.cfs_quota_us", "125000")]
    assert cpu.limit_files(Limits(64 << 20, 64, None)) == [("cpu.cfs_period_us", "100000"),
                                                          ("cpu.cfs_quota_us", "-1")]
    assert dict(io.limit_files(LIMITS))["blkio.weight"] == "200"


def test_implausible_limits_and_names_are_refused() -> None:
    with pytest.raises(ValueError):
        Limits(memory_max=1 << 20, pids_max=64, cpu_quota_us=None)
    with pytest.raises(ValueError):
        Limits(memory_max=64 << 20, pids_max=64, cpu_quota_us=None, io_weight=0)
    h = Hierarchies([], prefix="aenv")
    for bad in ("../x", "a/b", "cgroup.procs", ""):
        with pytest.raises(CgroupError):
            h.create(bad, LIMITS)


# -- on this host's kernel ----------------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroupfs)")


@pytest.fixture
def host(request) -> Hierarchies:
    try:
        h = Hierarchies.discover(prefix=f"aenvcgt{os.getpid()}")
    except CgroupError as e:
        pytest.skip(str(e))
    if not h.hierarchies:
        pytest.skip("no memory/cpu/pids/io controller on this host")
    yield h
    remove_cgroups(h)


def spawn_in(cg: VMCgroup, *argv: str) -> subprocess.Popen:
    """What the drivers do: the join wrapper of ``confine.Jail``."""
    jail = Jail(cg.vm_id, Path("/"), cgroup=cg, released=True)
    return subprocess.Popen(jail.wrap(list(argv)), start_new_session=True)


@needs_root
def test_limits_land_in_the_kernel_and_the_process_is_inside_before_it_execs(host) -> None:
    cg = host.create("vm1", LIMITS)
    # /proc/self/cgroup as the exec'd program sees it at its first instruction
    out = subprocess.run(Jail("vm1", Path("/"), cgroup=cg, released=True).wrap(
        ["cat", "/proc/self/cgroup"]), capture_output=True, text=True, check=True).stdout
    seen = {line.split(":", 2)[2] for line in out.splitlines()}
    for h, d in zip(host.hierarchies, cg.dirs, strict=True):
        assert "/" + str(d.relative_to(h.mount)) in seen, (d, out)
    if "memory" in host.controllers:
        stats = cg.memory_stats()
        assert stats["limit"] == 768 << 20
    if "pids" in host.controllers:
        assert cg.read("pids.max") == "160"
    if "cpu" in host.controllers:
        assert cg.read("cpu.max") == "125000 100000" or (
            cg.read("cpu.cfs_quota_us"), cg.read("cpu.cfs_period_us")) == ("125000", "100000")
    assert cg.remove() and not cg.exists()


@needs_root
def test_a_failed_join_never_runs_the_program(host, tmp_path) -> None:
    cg = host.create("vm2", LIMITS)
    cg.remove()
    marker = tmp_path / "ran"
    p = spawn_in(cg, "touch", str(marker))
    assert p.wait() == 125 and not marker.exists()


@needs_root
def test_kill_and_remove_a_cgroup_with_a_process_in_it(host) -> None:
    cg = host.create("vm3", LIMITS)
    p = spawn_in(cg, "sleep", "60")
    deadline = time.monotonic() + 5
    while not cg.contains(p.pid):  # in every hierarchy once the wrapper has exec'd
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not cg.remove(wait=False)  # busy while the process lives
    cg.kill()
    assert p.wait() == -signal.SIGKILL
    assert cg.remove() and not cg.exists()


@needs_root
def test_sweep_spares_kept_young_and_foreign_cgroups(host) -> None:
    kept = host.create("kept", LIMITS)
    young = host.create("young", LIMITS)
    old = host.create("old", LIMITS)
    foreign = host.create("foreign", LIMITS)
    ours = host.create("ours", LIMITS)
    p_foreign = spawn_in(foreign, "sleep", "60")
    p_ours = spawn_in(ours, "sleep", "60")
    try:
        for cg, p in ((foreign, p_foreign), (ours, p_ours)):
            while p.pid not in cg.pids():
                time.sleep(0.01)
        past = time.time() - 3600
        for d in old.dirs:
            os.utime(d, (past, past))
        removed, left = sweep(host, keep={"kept"}, owned=lambda pid, name: pid == p_ours.pid)
        assert sorted(removed) == ["old", "ours"]
        assert sorted(left) == ["foreign", "young"]
        assert kept.exists() and young.exists() and foreign.exists()
        assert not old.exists() and not ours.exists()
        assert p_ours.wait(5) == -signal.SIGKILL and p_foreign.poll() is None
    finally:
        for p in (p_foreign, p_ours):
            p.kill()
            p.wait()


@needs_root
def test_v2_core_in_a_tree_without_controllers() -> None:
    """Placement, cgroup.procs, cgroup.kill and removal in a real cgroup2 mount, with no
    controller (as a hybrid host's unified tree has); skipped without a cgroup2 mount."""
    mounts = [line.split(" - ")[0].split()[4] for line in
              Path("/proc/self/mountinfo").read_text().splitlines()
              if " - cgroup2 " in line]
    if not mounts:
        pytest.skip("no cgroup2 mount")
    mount = Path(mounts[0])
    own = Path("/proc/self/cgroup").read_text().splitlines()
    v2_own = next((line.split(":", 2)[2] for line in own if line.startswith("0::")), "/")
    h = Hierarchies([Hierarchy(2, mount, frozenset(), mount / v2_own.lstrip("/"))],
                    prefix=f"aenvcgt{os.getpid()}")
    try:
        cg = h.create("vm", LIMITS)
    except CgroupError as e:
        pytest.skip(f"cgroup2 here refuses a child: {e}")
    try:
        assert cg.dirs == (mount / f"aenvcgt{os.getpid()}-vms" / "vm",)
        p = spawn_in(cg, "sleep", "60")
        while p.pid not in cg.pids():
            time.sleep(0.01)
        cg.kill()
        assert p.wait(5) == -signal.SIGKILL
        assert cg.remove()
    finally:
        cg.kill()
        cg.remove()
        for parent in h.parent_dirs():
            parent.rmdir()
