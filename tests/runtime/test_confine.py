"""``aenv.runtime.confine`` without a VM: the limits a VM of a given size gets, the QEMU
options and the spawn a jail turns into, the uid reservations (one uid per VM, never two
VMs on one, stale ones freed only when no process uses them) and what release refuses.
The VM tests (``test_confinement.py``) show the same things on a running QEMU."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from aenv.runtime import VMLimits
from aenv.runtime import confine as cf
from aenv.runtime.base import VMSpec
from aenv.runtime.cgroups import Limits
from aenv.runtime.qemu_args import build_argv

MiB = 1 << 20
TEST_UIDS = 0x7E00_0000


def test_limits_from_the_vm_size() -> None:
    lim = cf.limits_for(2, 512, tcg_tb_mib=256)
    assert lim.memory_max == (512 + 64 + 160 + 256) * MiB
    assert lim.cpu_quota_us == 225_000 and lim.cpu_period_us == 100_000
    host = 8 * (os.cpu_count() or 1)  # io_uring's workers scale with the host's CPUs
    assert lim.pids_max == 160 + 16 + host and lim.swap_max == 0 and lim.io_weight == 200
    kvm = cf.limits_for(1, 1024)
    assert kvm.memory_max == (1024 + 128 + 160) * MiB


def test_overrides_win_field_by_field() -> None:
    lim = cf.limits_for(2, 512, overrides=VMLimits(memory_bytes=300 * MiB, cpus=0.5))
    assert lim.memory_max == 300 * MiB and lim.cpu_quota_us == 50_000
    assert lim.pids_max == 176 + 8 * (os.cpu_count() or 1)  # not overridden
    assert cf.limits_for(1, 256, overrides=VMLimits(cpus=0)).cpu_quota_us is None


def test_qemu_options_of_a_full_jail_come_last_on_the_line(tmp_path) -> None:
    jail = cf.Jail("vm", tmp_path, uid=1879048200, gid=cf.VMM_GID, seccomp=True, chroot=True,
                   released=True)
    assert jail.qemu_args() == [
        "-sandbox", "on,obsolete=deny,spawn=deny,resourcecontrol=deny",
        "-chroot", ".", "-runas", "1879048200:1879048192"]
    spec = VMSpec(vm_id="vm", workdir=tmp_path, kernel=tmp_path / "k", boot_args="")
    argv = build_argv(spec, "tcg", tcg_tb_mib=256, confine=jail.qemu_args())
    assert argv[-6:] == jail.qemu_args()
    assert argv[argv.index("-accel") + 1] == "tcg,tb-size=256"
    # chroot "." = the cwd: no host path on the line
    assert str(tmp_path) not in " ".join(argv)


def test_no_jail_no_wrapper(tmp_path) -> None:
    jail = cf.Jail("vm", tmp_path, released=True)
    assert jail.qemu_args() == [] and jail.wrap(["qemu"]) == ["qemu"]


def test_the_wrapper_passes_argv_through_untouched(tmp_path) -> None:
    """Arguments with spaces, quotes, ``--`` and ``$`` reach the program as given."""
    from aenv.runtime.cgroups import VMCgroup

    procs = tmp_path / "cg"
    procs.mkdir()
    jail = cf.Jail("vm", tmp_path, cgroup=VMCgroup("vm", (procs,)), released=True)
    args = ["printf", "%s|", "a b", "--", "$HOME", "'q'", ""]
    out = subprocess.run(jail.wrap(args), capture_output=True, text=True, check=True)
    assert out.stdout == "a b|--|$HOME|'q'||"
    # and wrote its own pid (the program's: exec keeps it) first
    assert (procs / "cgroup.procs").read_text().strip().isdigit()


# -- uid reservations ---------------------------------------------------------------------------


def conf(tmp_path: Path, count: int = 3) -> cf.Confinement:
    # a range of its own: VMs of other runs on this host hold uids of the real one
    return cf.Confinement(uid_base=TEST_UIDS, uid_count=count, ids_dir=tmp_path / "ids",
                          cgroups="off", chroot=False)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="uids are reserved as root only")


@needs_root
def test_every_vm_gets_its_own_uid_until_the_range_is_used_up(tmp_path) -> None:
    c = conf(tmp_path)
    jails = [cf.prepare(c, f"vm{i}", tmp_path / f"vm{i}", vcpus=1, memory_mib=256)
             for i in range(3)]
    assert [j.uid for j in jails] == [TEST_UIDS, TEST_UIDS + 1, TEST_UIDS + 2]
    assert cf.UID_BASE == 0x70000001 and all(j.gid == cf.VMM_GID == 0x70000000 for j in jails)
    entry = json.loads((c.ids_dir / str(TEST_UIDS + 1)).read_text())
    assert entry["vm_id"] == "vm1" and entry["workdir"] == str((tmp_path / "vm1").resolve())
    with pytest.raises(cf.ConfinementError, match="in use"):
        cf.prepare(c, "vm3", tmp_path / "vm3", vcpus=1, memory_mib=256)
    assert jails[1].release() and not (c.ids_dir / str(TEST_UIDS + 1)).exists()
    again = cf.prepare(c, "vm4", tmp_path / "vm4", vcpus=1, memory_mib=256)
    assert again.uid == TEST_UIDS + 1


@needs_root
def test_a_stale_reservation_is_taken_over_only_when_no_process_runs_under_it(
        tmp_path) -> None:
    c = conf(tmp_path, count=2)
    a = cf.prepare(c, "a", tmp_path / "a", vcpus=1, memory_mib=256)
    b = cf.prepare(c, "b", tmp_path / "b", vcpus=1, memory_mib=256)
    past = time.time() - 3600
    for j in (a, b):
        os.utime(c.ids_dir / str(j.uid), (past, past))
    # a process still runs under b's uid: b's reservation is not stale
    p = subprocess.Popen(["setpriv", f"--reuid={b.uid}", f"--regid={b.gid}", "--clear-groups",
                          "sleep", "30"])
    try:
        time.sleep(0.2)
        new = cf.prepare(c, "c", tmp_path / "c", vcpus=1, memory_mib=256)
        assert new.uid == a.uid
        assert not b.release()  # its uid is still in use
    finally:
        p.kill()
        p.wait()
    assert b.release()


@needs_root
def test_release_frees_only_its_own_reservation(tmp_path) -> None:
    c = conf(tmp_path)
    a = cf.prepare(c, "a", tmp_path / "a", vcpus=1, memory_mib=256)
    impostor = cf.Jail("a", tmp_path / "elsewhere", uid=a.uid, gid=a.gid, ids_dir=c.ids_dir)
    assert impostor.release()
    assert (c.ids_dir / str(a.uid)).exists()
    assert a.release() and not (c.ids_dir / str(a.uid)).exists()


@needs_root
def test_the_start_up_sweep_frees_uids_of_lost_vms_of_this_vms_dir_only(tmp_path) -> None:
    c = conf(tmp_path)
    mine = tmp_path / "vms"
    lost = cf.prepare(c, "lost", mine / "lost", vcpus=1, memory_mib=256)
    kept = cf.prepare(c, "kept", mine / "kept", vcpus=1, memory_mib=256)
    other = cf.prepare(c, "x", tmp_path / "other-server" / "x", vcpus=1, memory_mib=256)
    report = cf.cleanup_leftovers(c, mine, keep={"kept"})
    assert report["uids_freed"] == [str(lost.uid)]
    assert (c.ids_dir / str(kept.uid)).exists() and (c.ids_dir / str(other.uid)).exists()


def test_record_round_trip(tmp_path) -> None:
    from aenv.runtime.cgroups import VMCgroup

    jail = cf.Jail("vm", tmp_path, uid=5, gid=6, seccomp=True, chroot=True,
                   cgroup=VMCgroup("vm", (tmp_path / "a", tmp_path / "b")),
                   limits=Limits(64 * MiB, 64, None), ids_dir=tmp_path / "ids")
    back = cf.Jail.from_record("vm", tmp_path, json.loads(json.dumps(jail.record())))
    assert back == jail and not back.released
    assert cf.Jail.from_record("vm", tmp_path, None).released


def test_get_runtime_takes_the_servers_confinement() -> None:
    from types import SimpleNamespace

    from aenv.runtime import get_runtime

    conf = cf.Confinement.from_settings(SimpleNamespace(name_prefix="srv1"))
    for name in ("qemu", "firecracker"):
        assert get_runtime(name, confinement=conf).confinement.prefix == "srv1"
        assert get_runtime(name).confinement == cf.Confinement()
