"""``kill -9`` of the server while a sandbox mounts a volume: after a restart the guest's
mount still works (its NFS server outlived the crash), the volume's files are intact, and
killing the sandbox then stopping the server leaves no NFS server, no loop mount and no
namespace behind. Uses a server of its own, since it crashes it."""

from __future__ import annotations

import os

import pytest
from e2b import Sandbox, Volume

from .conftest import ServerProcess, crash_tested, sdk_pointed_at

pytestmark = [pytest.mark.vm, pytest.mark.net]


def _ganesha(srv: ServerProcess) -> list[int]:
    found = []
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            with open(f"/proc/{e.name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if cmd.startswith(b"ganesha.nfsd") and str(srv.home).encode() in cmd:
            found.append(int(e.name))
    return found


def _mounts_under(srv: ServerProcess) -> list[str]:
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(str(srv.home))]


@pytest.fixture
def crashable(tmp_path, monkeypatch):
    srv = ServerProcess(tmp_path / "home", prefix="aenvvp", net=121)
    with crash_tested(srv, lambda s: {"nfs servers": _ganesha(s), "mounts": _mounts_under(s)}), \
            sdk_pointed_at(srv):
        monkeypatch.setenv("E2B_VOLUME_API_URL", srv.url)
        yield srv


@pytest.mark.timeout(900)
def test_a_mounted_volume_survives_a_server_crash(crashable, monkeypatch) -> None:
    srv = crashable
    vol = Volume.create("crash")
    vol.write_file("/before.txt", "before the crash\n")
    sbx = Sandbox.create("base", timeout=600, volume_mounts={"/mnt/v": vol})
    assert sbx.commands.run("cat /mnt/v/before.txt").stdout == "before the crash\n"
    servers = _ganesha(srv)
    assert len(servers) == 1

    srv.kill9()
    srv.start()
    for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_VOLUME_API_URL"):
        monkeypatch.setenv(k, srv.url)  # a new port

    assert _ganesha(srv) == servers  # the guest's server was kept, not restarted
    again = Sandbox.connect(sbx.sandbox_id)
    again.commands.run("echo after >> /mnt/v/before.txt")
    vol = Volume.connect(vol.volume_id)
    assert vol.read_file("/before.txt") == "before the crash\nafter\n"
    assert again.kill()
    assert _ganesha(srv) == []  # ended with its slot
    assert Volume.destroy(vol.volume_id)
    assert _mounts_under(srv) == []
