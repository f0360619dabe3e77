"""Started processes join the workload cgroup before the command runs (guest behaviour,
checked on the host against a scratch cgroup in its cgroup v2 hierarchy)."""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.envd.process import launch
from aenv.envd.users import User


def _cgroup2_mount() -> Path | None:
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            if fstype == "cgroup2":
                return Path(mount)
    return None


@pytest.fixture
def workload() -> Iterator[Path]:
    mount = _cgroup2_mount()
    if os.geteuid() != 0 or mount is None:
        pytest.skip("needs root and a cgroup v2 hierarchy")
    cg = mount / f"aenv-test-workload-{os.getpid()}"
    cg.mkdir()
    try:
        yield cg
    finally:
        for pid in (cg / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while (cg / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.02)
        cg.rmdir()


def _run(cmd: str, user: User, cgroup: Path) -> tuple[int, str]:
    env = {"PATH": "/usr/bin:/bin"}
    spawned = launch.spawn(launch.LaunchSpec("/bin/sh", ["-c", cmd], env, "/tmp", user,
                                             False, None, cgroup))
    out = b""
    assert spawned.stdout is not None
    while True:
        select.select([spawned.stdout], [], [], 10)
        chunk = os.read(spawned.stdout, 65536)
        if not chunk:
            break
        out += chunk
    for fd in (spawned.stdout, spawned.stderr):
        os.close(fd)
    _, status = os.waitpid(spawned.pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode()


@pytest.mark.parametrize("name", ["root", "nobody"])
def test_the_command_and_what_it_forks_at_once_are_in_the_workload(workload, name,
                                                                   monkeypatch) -> None:
    # A slow envd (as under load): the command must wait for the move, not race it.
    real_move = launch.cgroups.move

    def slow_move(pid: int, cgroup: Path) -> None:
        time.sleep(0.3)
        real_move(pid, cgroup)

    monkeypatch.setattr(launch.cgroups, "move", slow_move)
    rel = "/" + workload.name
    code, out = _run("sleep 30 >/dev/null 2>&1 & echo $!; cat /proc/self/cgroup",
                     User.lookup(name), workload)
    assert code == 0, out
    grandchild, *own = out.split("\n")
    assert f"0::{rel}" in own  # the command itself
    with open(f"/proc/{grandchild}/cgroup") as f:
        assert f"0::{rel}\n" in f.read()  # forked before envd could have moved it later
    assert str(os.getpid()) not in (workload / "cgroup.procs").read_text().split()


def test_a_vanished_cgroup_still_runs_the_command(workload, tmp_path) -> None:
    code, out = _run("echo ran", User.lookup("root"), tmp_path / "gone")
    assert (code, out) == (0, "ran\n")
