"""``kill -9`` of the server while a pause's memory is written in the background (a restored
VM's pause answers before its memory is copied out of the frozen VMM: ``NodeMachines``'s
deferred pause). After the restart the paused sandbox is still there: the next start writes
its memory from the VMM that waited frozen, and the resume has the guest's memory and files
of the moment of the pause. When the VMM did not survive either, the snapshot keeps its
``memory.pending`` marker and the resume is refused with that reason, never made from a
half-written layer. A resume during the write continues the frozen VMM in place: a crash
right after it, or between the abandon of the snapshot and the VMM's ``cont`` (the store's
record ``resuming``, the marker ``memory.abandoned``), finds the sandbox running in that VM
after the restart, with its memory and files, the abandoned snapshot collected, and its next
pause and resume as usual; with the VM gone too it is reported lost. Uses a server of its
own (prefix ``aenvpm``, nets 181-182), since it crashes it."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import time

import pytest
from e2b import Sandbox

from aenv.runtime import workdir as wd
from aenv.storage import snapshots as snap

from .conftest import ServerProcess, crash_tested, sdk_pointed_at

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(900)]

DIRTY_MIB = 200  # long enough a copy (hundreds of ms) for the crash to land in it
DIRTY = (f"python3 -c \"import time; x = bytearray(b'\\xa5') * ({DIRTY_MIB} << 20); "
         "open('/tmp/dirty-ready', 'w').close(); time.sleep(3600)\"")
CHECK = ("python3 -c \"import hashlib; print(hashlib.md5(open('/dev/shm/probe', 'rb')"
         ".read()).hexdigest())\"")


@pytest.fixture
def crashable(tmp_path):
    with crash_tested(ServerProcess(tmp_path / "home", prefix="aenvpm", net=181)) as srv, \
            sdk_pointed_at(srv):
        yield srv


def _dirtied(srv: ServerProcess, name: str) -> tuple[Sandbox, str]:
    """A sandbox (restored from base, as every create) with a probe file in guest RAM
    (tmpfs) and ``DIRTY_MIB`` MiB of written memory; the probe's digest."""
    sbx = Sandbox.create("base", timeout=900, metadata={"case": name})
    sbx.commands.run("head -c 8388608 /dev/urandom > /dev/shm/probe", user="root")
    digest = sbx.commands.run(CHECK).stdout.strip()
    sbx.files.write("/home/user/state.txt", f"{name} before the pause")
    sbx.commands.run(DIRTY, background=True)
    deadline = time.monotonic() + 300
    while sbx.commands.run("test -e /tmp/dirty-ready || echo no").stdout.strip():
        assert time.monotonic() < deadline, "the guest did not dirty its memory"
        time.sleep(0.5)
    return sbx, digest


def _pause_and_crash(srv: ServerProcess, sbx: Sandbox) -> tuple[str, snap.PendingMemory]:
    """Pause through the API; kill -9 the server as soon as it answered, while the
    memory is still being written (its marker is there). Returns the snapshot's name and
    its marker."""
    with srv.api() as c:
        r = c.post(f"/sandboxes/{sbx.sandbox_id}/pause")
        assert r.status_code == 204, r.text
        markers = list(srv.settings.snapshots_dir.glob(f"*/{snap.MEMORY_PENDING}"))
        srv.kill9()
    assert len(markers) == 1, "the pause's memory was written before the crash"
    pending = snap.read_pending(markers[0].parent)
    assert pending is not None and pending.note["sandbox"] == sbx.sandbox_id
    return markers[0].parent.name, pending


def test_a_crash_while_a_pause_writes_memory_loses_no_paused_sandbox(crashable) -> None:
    srv = crashable
    sbx, digest = _dirtied(srv, "survives")
    name, _ = _pause_and_crash(srv, sbx)
    srv.start()

    again = Sandbox.connect(sbx.sandbox_id)
    assert again.files.read("/home/user/state.txt") == "survives before the pause"
    assert again.commands.run(CHECK).stdout.strip() == digest
    assert again.commands.run("test -e /tmp/dirty-ready && echo yes").stdout.strip() == "yes"
    assert not snap.memory_pending(srv.settings.snapshots_dir / name)
    log = srv.log_path.read_text()
    assert "interrupted by the restart, from its frozen VMM" in log
    again.kill()


def test_a_pause_whose_vmm_died_with_the_server_is_refused_on_resume(crashable) -> None:
    srv = crashable
    sbx, _ = _dirtied(srv, "lost")
    name, pending = _pause_and_crash(srv, sbx)
    pid = int((pending.vm_dir / wd.PIDFILE).read_text().strip())
    os.kill(pid, signal.SIGKILL)  # the host lost the frozen VMM too
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    srv.start()

    assert snap.memory_pending(srv.settings.snapshots_dir / name)  # never half-resumed
    with srv.api() as c:
        r = c.post(f"/sandboxes/{sbx.sandbox_id}/resume", json={})
        assert r.status_code == 409, r.text
        assert "memory layer is incomplete" in r.text
        assert c.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "paused"
        assert c.delete(f"/sandboxes/{sbx.sandbox_id}").status_code == 204


def _checks_out(sid: str, name: str, digest: str) -> Sandbox:
    """The sandbox answers with the memory and files of the moment of its pause."""
    again = Sandbox.connect(sid)
    assert again.files.read("/home/user/state.txt") == f"{name} before the pause"
    assert again.commands.run(CHECK).stdout.strip() == digest
    assert again.commands.run("test -e /tmp/dirty-ready && echo yes").stdout.strip() == "yes"
    return again


def _pauses_and_resumes_as_usual(srv: ServerProcess, sbx: Sandbox, name: str,
                                 digest: str) -> None:
    """A VM continued in place pauses again (its memory diffed against the same parent as
    before) and, once that memory is written, restores from it."""
    with srv.api() as c:
        assert c.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
    deadline = time.monotonic() + 120
    while list(srv.settings.snapshots_dir.glob(f"*/{snap.MEMORY_PENDING}")):
        assert time.monotonic() < deadline, "the second pause's memory was never written"
        time.sleep(0.2)
    _checks_out(sbx.sandbox_id, name, digest).kill()


def _state(srv: ServerProcess, sid: str) -> str | None:
    with srv.api() as c:
        r = c.get(f"/sandboxes/{sid}")
        return r.json()["state"] if r.status_code == 200 else None


def test_a_crash_right_after_a_resume_in_place_keeps_it_running(crashable) -> None:
    srv = crashable
    sbx, digest = _dirtied(srv, "inplace")
    with srv.api() as c:
        assert c.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
        r = c.post(f"/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 900})
        assert r.status_code in (200, 201), r.text
        srv.kill9()
    # The log names the abandoned snapshot: its directory may already be gone, since every
    # resume starts a collection in the background.
    found = re.search(r"continued in place in slot \d+ \(its pause to (\S+) ",
                      srv.log_path.read_text())
    assert found, "the resume did not continue the VM in place"
    abandoned = srv.settings.snapshots_dir / found.group(1)
    srv.start()

    assert _state(srv, sbx.sandbox_id) == "running"
    again = _checks_out(sbx.sandbox_id, "inplace", digest)
    assert not abandoned.exists(), "the abandoned snapshot was not collected"
    _pauses_and_resumes_as_usual(srv, again, "inplace", digest)


def _cut_between_abandon_and_cont(srv: ServerProcess, sbx: Sandbox) -> snap.PendingMemory:
    """The state a crash leaves after a resume in place renamed the marker and before it
    ran ``cont``: the VMM frozen, the marker ``memory.abandoned``, the record ``resuming``
    (made by hand while the server is down)."""
    name, pending = _pause_and_crash(srv, sbx)
    snap.abandon_pending(srv.settings.snapshots_dir / name)
    db = sqlite3.connect(srv.settings.home / "aenv.db")
    try:
        with db:
            changed = db.execute("UPDATE sandboxes SET state = 'resuming' WHERE id = ? AND "
                                 "state = 'paused'", (sbx.sandbox_id,)).rowcount
        assert changed == 1
    finally:
        db.close()
    return pending


def test_a_crash_between_the_abandon_and_the_cont_finishes_the_resume(crashable) -> None:
    srv = crashable
    sbx, digest = _dirtied(srv, "cut")
    _cut_between_abandon_and_cont(srv, sbx)
    srv.start()

    assert _state(srv, sbx.sandbox_id) == "running"
    assert "its resume in place finished after the restart" in srv.log_path.read_text()
    assert not list(srv.settings.snapshots_dir.glob(f"*/{snap.MEMORY_ABANDONED}"))
    again = _checks_out(sbx.sandbox_id, "cut", digest)
    _pauses_and_resumes_as_usual(srv, again, "cut", digest)


def test_a_cut_resume_in_place_whose_vmm_died_is_reported_lost(crashable) -> None:
    srv = crashable
    sbx, _ = _dirtied(srv, "cutlost")
    pending = _cut_between_abandon_and_cont(srv, sbx)
    pid = int((pending.vm_dir / wd.PIDFILE).read_text().strip())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    srv.start()

    assert _state(srv, sbx.sandbox_id) is None  # ended: lost
    assert "did not survive" in srv.log_path.read_text()
    assert not list(srv.settings.snapshots_dir.glob(f"*/{snap.MEMORY_ABANDONED}"))
    assert not pending.vm_dir.exists()
