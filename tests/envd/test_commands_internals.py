"""Unit tests of building blocks of envd's process service: the output fan-out, the end-event
wording, and both ways ``launch.spawn`` switches user."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest

from aenv.envd.process import launch
from aenv.envd.process.exit import ExitStatus, signal_name
from aenv.envd.process.fanout import SUBSCRIBER_LIMIT, OutputFanout
from aenv.envd.users import User

END = ExitStatus(0, True, "exit status 0", None)


def wait_status(*argv: str, sig: int | None = None) -> int:
    proc = subprocess.Popen(argv)
    if sig is not None:
        os.kill(proc.pid, sig)
    _, status = os.waitpid(proc.pid, 0)
    proc.returncode = 0  # reaped here; keep Popen from waiting again
    return status


async def test_subscription_gets_chunks_in_order_then_the_end() -> None:
    fanout = OutputFanout(on_drain=lambda: None)
    sub = fanout.subscribe()
    fanout.publish("stdout", b"a")
    fanout.publish("stderr", b"b")
    fanout.finish(END)
    assert [await sub.get(1) for _ in range(3)] == [("stdout", b"a"), ("stderr", b"b"), END]


async def test_get_times_out_with_none_when_silent() -> None:
    sub = OutputFanout(on_drain=lambda: None).subscribe()
    assert await sub.get(0.01) is None


async def test_get_wakes_on_publish() -> None:
    fanout = OutputFanout(on_drain=lambda: None)
    sub = fanout.subscribe()
    asyncio.get_running_loop().call_later(0.01, fanout.publish, "stdout", b"x")
    assert await sub.get(5) == ("stdout", b"x")


async def test_output_before_subscribing_is_not_seen() -> None:
    fanout = OutputFanout(on_drain=lambda: None)
    fanout.publish("stdout", b"early")
    sub = fanout.subscribe()
    fanout.publish("stdout", b"late")
    assert await sub.get(1) == ("stdout", b"late")


async def test_full_subscription_blocks_until_drained_below_the_limit() -> None:
    drained: list[bool] = []
    fanout = OutputFanout(on_drain=lambda: drained.append(True))
    sub = fanout.subscribe()
    chunk = b"x" * (SUBSCRIBER_LIMIT // 2)
    fanout.publish("stdout", chunk)
    assert not fanout.blocked
    fanout.publish("stdout", chunk)
    assert fanout.blocked and not drained
    await sub.get(1)
    assert not fanout.blocked and drained == [True]


async def test_closing_a_full_subscription_unblocks() -> None:
    drained: list[bool] = []
    fanout = OutputFanout(on_drain=lambda: drained.append(True))
    sub = fanout.subscribe()
    fanout.publish("stdout", b"x" * SUBSCRIBER_LIMIT)
    assert fanout.blocked
    sub.close()
    assert not fanout.blocked and drained == [True]


async def test_end_is_accepted_past_the_limit() -> None:
    fanout = OutputFanout(on_drain=lambda: None)
    sub = fanout.subscribe()
    fanout.publish("stdout", b"x" * SUBSCRIBER_LIMIT)
    fanout.finish(END)
    await sub.get(1)
    assert await sub.get(1) == END


async def test_subscribing_after_the_end_yields_only_the_end() -> None:
    fanout = OutputFanout(on_drain=lambda: None)
    fanout.finish(END)
    assert await fanout.subscribe().get(1) == END


def test_clean_exit_has_no_error() -> None:
    assert ExitStatus.from_wait_status(wait_status("true")) == END


def test_exit_code_is_reported_with_go_wording() -> None:
    assert ExitStatus.from_wait_status(wait_status("sh", "-c", "exit 3")) == ExitStatus(
        3, True, "exit status 3", "exit status 3")


def test_sigkill_is_signal_killed_with_code_minus_one() -> None:
    status = ExitStatus.from_wait_status(wait_status("sleep", "10", sig=signal.SIGKILL))
    assert status == ExitStatus(-1, False, "signal: killed", "signal: killed")


def test_sigterm_is_signal_terminated() -> None:
    status = ExitStatus.from_wait_status(wait_status("sleep", "10", sig=signal.SIGTERM))
    assert status.status == "signal: terminated"


def test_signal_names_follow_go() -> None:
    assert [signal_name(s) for s in (1, 2, 11, 13)] == [
        "hangup", "interrupt", "segmentation fault", "broken pipe"]
    assert signal_name(34) == "signal 34"


def _spawn_output(spec) -> tuple[bytes, int]:
    spawned = launch.spawn(spec)
    assert spawned.stdout is not None
    os.set_blocking(spawned.stdout, True)
    out = b""
    while chunk := os.read(spawned.stdout, 65536):
        out += chunk
    for fd in (spawned.stdout, spawned.stderr, spawned.stdin):
        if fd is not None:
            os.close(fd)
    _, status = os.waitpid(spawned.pid, 0)
    spawned.reaped(status)
    return out, status


def _whoami_spec(cmd: str) -> launch.LaunchSpec:
    user = User.lookup("user")
    env = {"PATH": os.environ["PATH"], "HOME": user.home}
    return launch.LaunchSpec("/bin/sh", ["-c", cmd], env, "/tmp", user, False, None)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_spawn_switches_user_and_cwd_through_setpriv() -> None:
    assert launch._SETPRIV is not None, "util-linux setpriv is expected on the host"
    out, status = _spawn_output(_whoami_spec("id -u; id -G; pwd"))
    user = User.lookup("user")
    assert out.decode().split("\n")[:3] == [
        str(user.uid), " ".join(map(str, sorted(set(user.groups)))), "/tmp"]
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_spawn_falls_back_to_fork_without_setpriv(monkeypatch) -> None:
    monkeypatch.setattr(launch, "_SETPRIV", None)
    out, _ = _spawn_output(_whoami_spec("id -un; pwd"))
    assert out == b"user\n/tmp\n"


def _pty_output(spec) -> bytes:
    spawned = launch.spawn(spec)
    assert spawned.pty is not None
    os.set_blocking(spawned.pty, True)
    out = b""
    while True:
        try:
            chunk = os.read(spawned.pty, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(spawned.pty)
    spawned.reaped(os.waitpid(spawned.pid, 0)[1])
    return out


def _pty_spec() -> launch.LaunchSpec:
    spec = _whoami_spec("id -un; [ $(cut -d' ' -f6 /proc/$$/stat) = $$ ] && echo LEADER; "
                        "(exec 3</dev/tty) && echo CTTY; stty size")
    return launch.LaunchSpec(spec.cmd, spec.args, spec.env, spec.cwd, spec.user, True, (90, 30))


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_pty_child_is_a_session_leader_owning_the_terminal() -> None:
    out = _pty_output(_pty_spec())
    assert out.split(b"\r\n")[:4] == [b"user", b"LEADER", b"CTTY", b"30 90"]


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_pty_fallback_without_setpriv_also_owns_the_terminal(monkeypatch) -> None:
    monkeypatch.setattr(launch, "_SETPRIV", None)
    out = _pty_output(_pty_spec())
    assert out.split(b"\r\n")[:4] == [b"user", b"LEADER", b"CTTY", b"30 90"]
