"""``kill -9`` of the server while the chains of persistent snapshots are being compacted in
the background (``aenv.runtime.compaction``): after the restart every snapshot still
restores with the files of its moment, and the compaction the crash interrupted is
finished. Uses a server of its own (prefix ``aenvhc``, nets 158-159), since it crashes it."""

from __future__ import annotations

import time

import httpx
import pytest
from e2b import Sandbox

from aenv.orchestrator.timing import parse_server_timing
from aenv.runtime.qemu_snapshot import DEFAULT_MAX_CHAIN
from aenv.storage import snapshots as snap

from .conftest import ServerProcess, crash_tested, sdk_pointed_at

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(900)]

SNAPSHOTS = DEFAULT_MAX_CHAIN + 3  # the chain outgrows the limit twice


@pytest.fixture
def crashable(tmp_path):
    with crash_tested(ServerProcess(tmp_path / "home", prefix="aenvhc", net=158)) as srv, \
            sdk_pointed_at(srv):
        yield srv


def _chains(srv) -> dict[str, int]:
    """Each complete snapshot's rootfs chain length, as its manifest has it."""
    out = {}
    for d in srv.settings.snapshots_dir.iterdir():
        try:
            out[d.name] = len(snap.read_manifest(d).drive("rootfs").chain)
        except (snap.SnapshotFilesError, KeyError):
            continue
    return out


def _memory_depths(srv) -> dict[str, int]:
    """Each complete snapshot's memory stack depth (diff layers), as its manifest has it."""
    out = {}
    for d in srv.settings.snapshots_dir.iterdir():
        try:
            out[d.name] = snap.read_manifest(d).diff_depth
        except snap.SnapshotFilesError:
            continue
    return out


def test_a_crash_while_chains_are_compacted_loses_no_snapshot(crashable) -> None:
    srv = crashable
    sbx = Sandbox.create("base", timeout=900)
    ids = []
    for i in range(SNAPSHOTS - 1):
        sbx.files.write(f"/home/user/gen{i}", f"generation {i}")
        ids.append(sbx.create_snapshot().snapshot_id)
    # The last one through the API by hand: its answer says where the capture's time went.
    sbx.files.write(f"/home/user/gen{SNAPSHOTS - 1}", f"generation {SNAPSHOTS - 1}")
    r = httpx.post(f"{srv.url}/sandboxes/{sbx.sandbox_id}/snapshots", json={},
                   headers={"X-API-KEY": srv.api_key}, timeout=120)
    assert r.status_code == 201, r.text
    ids.append(r.json()["snapshotID"])
    phases = parse_server_timing(r.headers["Server-Timing"])
    assert {"lock", "plan", "freeze", "save_memory", "drives", "thaw", "commit"} <= \
        set(phases), phases
    assert set(parse_server_timing(r.headers["Server-Timing"], totals=True)) == {"total"}
    # The last captures' compactions are flattening, or waiting to release the old chain.
    srv.kill9()
    srv.start()

    for i, sid in enumerate(ids):
        child = Sandbox.create(sid)
        try:
            for j in range(i + 1):
                assert child.files.read(f"/home/user/gen{j}") == f"generation {j}", (i, j)
            assert not child.files.exists(f"/home/user/gen{i + 1}")
        finally:
            child.kill()
    # The restart finished what the crash interrupted: no chain or memory stack is left too
    # deep, and no half-made flattened copy or merged layer is left beside a drive.
    deadline = time.monotonic() + 120
    while max(_chains(srv).values()) + 1 > DEFAULT_MAX_CHAIN or \
            max(_memory_depths(srv).values()) > DEFAULT_MAX_CHAIN:
        assert time.monotonic() < deadline, (_chains(srv), _memory_depths(srv))
        time.sleep(1)
    assert not list(srv.settings.snapshots_dir.glob("*/.*.compacting"))
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.files.read(f"/home/user/gen{SNAPSHOTS - 1}") == f"generation {SNAPSHOTS - 1}"
    again.kill()
