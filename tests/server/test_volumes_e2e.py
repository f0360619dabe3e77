"""Volumes end to end with the real E2B SDK and microVMs: ``e2b.Volume`` (control plane and
content API, ``E2B_VOLUME_API_URL`` pointed at the server) and ``Sandbox.create(
volume_mounts=...)``, with the guest reading and writing the mount through ``commands.run``.

Shown: files written through the content API are seen in two sandboxes at once and what a
sandbox writes is read back through the API; a pause/resume keeps the mount working; a fork
child sees the volume itself (its writes reach the parent and the API); a full volume is a
clear error in the guest and in the API; a mounted volume cannot be deleted, an unmounted
one can; an unknown volume name is a 400; each sandbox reaches only its own NFS server.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox, Volume
from e2b.exceptions import InvalidArgumentException, SandboxException, VolumeException

pytestmark = [pytest.mark.vm, pytest.mark.net]

MNT = "/mnt/shared"


@pytest.fixture
def volume_sdk(sdk) -> Iterator:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2B_VOLUME_API_URL", sdk.url)
        yield sdk


def _run(sbx: Sandbox, cmd: str) -> str:
    return sbx.commands.run(cmd, timeout=120).stdout


@pytest.mark.timeout(900)
def test_a_volume_shared_by_sandboxes_across_pause_and_fork(volume_sdk) -> None:
    vol = Volume.create("e2e-shared")
    sandboxes: list[Sandbox] = []
    snap = None
    try:
        vol.write_file("/from-api.txt", "written through the API\n")
        a = Sandbox.create("base", timeout=600, volume_mounts={MNT: vol})
        sandboxes.append(a)
        b = Sandbox.create("base", timeout=600, volume_mounts={MNT: "e2e-shared"})
        sandboxes.append(b)
        assert [(m["name"], m["path"]) for m in a.get_info().volume_mounts] == \
            [("e2e-shared", MNT)]
        listed = {s.sandbox_id: s for s in Sandbox.list().next_items()}
        assert [m["path"] for m in listed[b.sandbox_id].volume_mounts] == [MNT]

        assert _run(a, f"cat {MNT}/from-api.txt") == "written through the API\n"
        assert "nfs4" in _run(a, f"grep ' {MNT} ' /proc/mounts")
        _run(a, f"echo from-a > {MNT}/a.txt")
        assert _run(b, f"cat {MNT}/a.txt") == "from-a\n"  # two guests, one volume
        _run(b, f"mkdir -p {MNT}/dir && echo from-b > {MNT}/dir/b.txt")
        assert vol.read_file("/dir/b.txt") == "from-b\n"
        assert vol.get_info("/dir/b.txt").uid == 1000  # the sandbox user wrote it

        # pause and resume: the resumed guest's NFS client reconnects to a new server
        assert a.pause()
        vol.write_file("/while-paused.txt", "later\n")
        a = Sandbox.connect(a.sandbox_id)
        sandboxes[0] = a
        assert _run(a, f"cat {MNT}/while-paused.txt") == "later\n"
        _run(a, f"echo after-resume > {MNT}/resumed.txt")
        assert vol.read_file("/resumed.txt") == "after-resume\n"

        # fork: the child mounts the volume itself, not a copy
        (child,) = a.fork(count=1)
        assert isinstance(child, Sandbox), child
        sandboxes.append(child)
        _run(child, f"echo from-child > {MNT}/child.txt")
        assert _run(a, f"cat {MNT}/child.txt") == "from-child\n"
        assert vol.read_file("/child.txt") == "from-child\n"
        assert [m["name"] for m in child.get_info().volume_mounts] == ["e2e-shared"]

        # a persistent snapshot's sandboxes mount the volume too (its guest had it)
        snap = child.create_snapshot()
        from_snap = Sandbox.create(snap.snapshot_id, timeout=300)
        sandboxes.append(from_snap)
        assert [m["path"] for m in from_snap.get_info().volume_mounts] == [MNT]
        _run(from_snap, f"echo from-snapshot > {MNT}/snap.txt")
        assert vol.read_file("/snap.txt") == "from-snapshot\n"

        # a mounted volume is not deleted
        with pytest.raises(Exception, match="409"):
            Volume.destroy(vol.volume_id)
    finally:
        for s in sandboxes:
            s.kill()
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id)
    assert Volume.destroy(vol.volume_id)
    assert not Volume.destroy(vol.volume_id)


@pytest.mark.timeout(600)
def test_a_full_volume_is_a_clear_error_and_other_volumes_are_out_of_reach(
        volume_sdk) -> None:
    # 64 MiB (aenv's sizeMB; the SDK has no size): filling the default 1 GiB over NFS
    # under TCG would take minutes.
    with httpx.Client(base_url=volume_sdk.url, headers={"X-API-KEY": volume_sdk.api_key}) as c:
        r = c.post("/volumes", json={"name": "e2e-quota", "sizeMB": 64})
        assert r.status_code == 201, r.text
    vol, other = Volume.connect(r.json()["volumeID"]), Volume.create("e2e-other")
    sbx = None
    try:
        sbx = Sandbox.create("base", timeout=300, volume_mounts={MNT: vol})
        size_mb = int(_run(sbx, f"df -m --output=size {MNT} | tail -1"))
        assert 48 <= size_mb <= 64
        result = sbx.commands.run(
            f"dd if=/dev/zero of={MNT}/fill bs=1M count={size_mb + 64} conv=fsync 2>&1 "
            "|| echo FAILED", timeout=600)
        assert "No space left on device" in result.stdout and "FAILED" in result.stdout
        with pytest.raises(VolumeException, match=r"507.*full"):
            vol.write_file("/more.bin", b"x" * (1024 * 1024))
        _run(sbx, f"rm -f {MNT}/fill")
        vol.write_file("/more.bin", b"x" * 1024)  # room again

        # Its NFS server exports only its own volumes: another one's export is refused,
        # even to root, while a second mount of its own works.
        other.write_file("/private.txt", "not yours")
        tried = sbx.commands.run(
            f"mkdir -p /mnt/o /mnt/own && (mount -t nfs4 -o vers=4.2,addr=169.254.0.22 "
            f"169.254.0.22:/{other.volume_id} /mnt/o && cat /mnt/o/private.txt; "
            f"echo rc=$?) 2>&1; mount -t nfs4 -o vers=4.2,addr=169.254.0.22 "
            f"169.254.0.22:/{vol.volume_id} /mnt/own && ls /mnt/own",
            user="root", timeout=120)
        assert "not yours" not in tried.stdout and "rc=0" not in tried.stdout, tried.stdout
        assert "more.bin" in tried.stdout
    finally:
        if sbx is not None:
            sbx.kill()
        Volume.destroy(vol.volume_id)
        Volume.destroy(other.volume_id)


def test_unknown_volume_names_are_refused(volume_sdk) -> None:
    with pytest.raises((InvalidArgumentException, SandboxException), match="does not exist"):
        Sandbox.create("base", volume_mounts={MNT: "no-such-volume"})
