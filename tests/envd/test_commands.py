"""``sandbox.commands`` through the real (sync) E2B SDK against envd on the host."""

from __future__ import annotations

import threading
import time

import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
    TimeoutException,
)


def pid_alive(sandbox, pid: int) -> bool:
    """``kill -0`` from a fresh command, as the SDK's own kill test does (as root, so a
    process of another user still answers)."""
    return sandbox.commands.run(f"kill -0 {pid} 2>/dev/null && echo yes || echo no",
                                user="root").stdout.strip() == "yes"


def test_run_returns_stdout_and_exit_code_zero(sandbox) -> None:
    result = sandbox.commands.run("echo hello")
    assert result.stdout == "hello\n"
    assert result.stderr == ""
    assert result.exit_code == 0
    assert result.error is None


def test_callbacks_receive_stdout_and_stderr(sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    sandbox.commands.run("echo to-out; echo to-err >&2", on_stdout=out.append,
                         on_stderr=err.append)
    assert "".join(out) == "to-out\n"
    assert "".join(err) == "to-err\n"


def test_nonzero_exit_raises_command_exit_exception(sandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        sandbox.commands.run("echo partial; echo bad >&2; exit 3")
    assert info.value.exit_code == 3
    assert info.value.stdout == "partial\n"
    assert info.value.stderr == "bad\n"
    assert info.value.error == "exit status 3"


def test_background_command_is_listed_then_waited(sandbox) -> None:
    handle = sandbox.commands.run("sleep 0.5; echo done", background=True)
    listed = {p.pid: p for p in sandbox.commands.list()}
    assert handle.pid in listed
    assert listed[handle.pid].cmd == "/bin/bash"
    assert listed[handle.pid].args == ["-l", "-c", "sleep 0.5; echo done"]
    assert listed[handle.pid].cwd is None
    assert listed[handle.pid].tag is None
    assert handle.wait().stdout == "done\n"
    assert handle.pid not in {p.pid for p in sandbox.commands.list()}


def test_list_shows_two_background_sleeps(sandbox) -> None:
    a = sandbox.commands.run("sleep 10", background=True)
    b = sandbox.commands.run("sleep 10", background=True)
    try:
        pids = {p.pid for p in sandbox.commands.list()}
        assert {a.pid, b.pid} <= pids
    finally:
        a.kill()
        b.kill()


def test_list_reports_request_envs_and_cwd_only(sandbox) -> None:
    handle = sandbox.commands.run("sleep 10", background=True, envs={"ONLY": "me"}, cwd="/tmp")
    try:
        info = next(p for p in sandbox.commands.list() if p.pid == handle.pid)
        assert info.envs == {"ONLY": "me"}
        assert info.cwd == "/tmp"
    finally:
        handle.kill()


def test_stdin_is_echoed_by_cat_after_close(sandbox) -> None:
    handle = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "Hello, World!")
    sandbox.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert result.exit_code == 0
    assert result.stdout == "Hello, World!"


def test_stream_input_feeds_stdin_in_order(sandbox) -> None:
    handle = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.stream_input(handle.pid, ["a", "b", "c"])
    sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "abc"


def test_close_stdin_twice_is_a_noop(sandbox) -> None:
    handle = sandbox.commands.run("cat; echo eof; sleep 10", background=True, stdin=True)
    try:
        sandbox.commands.close_stdin(handle.pid)
        sandbox.commands.close_stdin(handle.pid)
        assert any(out and "eof" in out for out, _, _ in handle)
    finally:
        sandbox.commands.kill(handle.pid)


def test_send_stdin_without_stdin_is_refused(sandbox) -> None:
    handle = sandbox.commands.run("sleep 10", background=True)
    try:
        with pytest.raises(SandboxException, match="stdin not enabled or closed"):
            sandbox.commands.send_stdin(handle.pid, "x")
    finally:
        handle.kill()


def test_stdin_false_reads_dev_null(sandbox) -> None:
    assert sandbox.commands.run("cat; echo eof").stdout == "eof\n"


def test_kill_reaps_the_process_at_once(sandbox) -> None:
    handle = sandbox.commands.run("sleep 30", background=True)
    assert sandbox.commands.kill(handle.pid) is True
    assert not pid_alive(sandbox, handle.pid)
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == -1
    assert info.value.error == "signal: killed"


def test_kill_ends_stream_even_when_grandchild_holds_pipes(sandbox, tmp_path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    handle = sandbox.commands.run(f"sleep 30 & echo $! > {pidfile}; sleep 30", background=True,
                                  user="root")
    try:
        while not pidfile.exists() or not pidfile.read_text().strip():
            time.sleep(0.05)
        started = time.monotonic()
        sandbox.commands.kill(handle.pid)
        with pytest.raises(CommandExitException):
            handle.wait()
        assert time.monotonic() - started < 5
    finally:
        if pidfile.exists():
            sandbox.commands.run(f"kill -KILL $(cat {pidfile}) || true", user="root")


def test_kill_unknown_pid_returns_false(sandbox) -> None:
    assert sandbox.commands.kill(999999) is False


@pytest.mark.slow
def test_timeout_kills_foreground_command(sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 10", timeout=2)
    assert time.monotonic() - started < 8
    deadline = time.monotonic() + 5
    while any(p.args[-1] == "sleep 10" for p in sandbox.commands.list()):
        assert time.monotonic() < deadline, "command outlived its timeout"
        time.sleep(0.05)


def test_timeout_kills_background_command_nobody_waits_for(sandbox) -> None:
    handle = sandbox.commands.run("sleep 20", background=True, timeout=1)
    handle.disconnect()
    deadline = time.monotonic() + 10
    while handle.pid in {p.pid for p in sandbox.commands.list()}:
        assert time.monotonic() < deadline, "background command outlived its timeout"
        time.sleep(0.2)
    assert not pid_alive(sandbox, handle.pid)


def test_disconnect_does_not_kill_the_process(sandbox) -> None:
    handle = sandbox.commands.run("sleep 3; echo still-here", background=True)
    handle.disconnect()
    time.sleep(0.3)
    assert handle.pid in {p.pid for p in sandbox.commands.list()}
    assert pid_alive(sandbox, handle.pid)
    sandbox.commands.kill(handle.pid)


def test_command_envs_apply_and_do_not_leak(sandbox) -> None:
    assert sandbox.commands.run("echo $FOO", envs={"FOO": "bar"}).stdout == "bar\n"
    assert sandbox.commands.run("echo ${FOO:-unset}").stdout == "unset\n"


def test_sandbox_envs_from_init_reach_commands(sandbox) -> None:
    assert sandbox.commands.run("echo $E2B_SANDBOX").stdout == "true\n"


def test_command_envs_override_sandbox_envs(sandbox) -> None:
    out = sandbox.commands.run("echo $E2B_SANDBOX", envs={"E2B_SANDBOX": "overridden"})
    assert out.stdout == "overridden\n"


def test_environment_is_built_from_scratch(sandbox) -> None:
    env = sandbox.commands.run("env").stdout
    assert "PYTEST_CURRENT_TEST" not in env
    assert "E2B_SANDBOX_URL" not in env


def test_default_cwd_is_the_users_home(sandbox) -> None:
    assert sandbox.commands.run("pwd").stdout == "/home/user\n"


def test_cwd_is_honoured(sandbox) -> None:
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"


def test_relative_cwd_resolves_against_home(sandbox) -> None:
    sandbox.commands.run("mkdir -p rel-cwd-test")
    try:
        assert sandbox.commands.run("pwd", cwd="rel-cwd-test").stdout == "/home/user/rel-cwd-test\n"
    finally:
        sandbox.commands.run("rmdir rel-cwd-test")


def test_missing_cwd_is_invalid_argument(sandbox) -> None:
    with pytest.raises(InvalidArgumentException, match="cwd '/nonexistent-dir' does not exist"):
        sandbox.commands.run("pwd", cwd="/nonexistent-dir")


def test_default_user_is_user_with_its_home(sandbox) -> None:
    assert sandbox.commands.run("whoami; echo $HOME").stdout == "user\n/home/user\n"


def test_root_user_runs_as_root(sandbox) -> None:
    out = sandbox.commands.run("whoami; echo $HOME; pwd", user="root").stdout
    assert out == "root\n/root\n/root\n"


def test_user_gets_its_supplementary_groups(sandbox) -> None:
    expected = sandbox.commands.run("id -G user", user="root").stdout
    assert sandbox.commands.run("id -G").stdout == expected


def test_unknown_user_is_an_authentication_error(sandbox) -> None:
    with pytest.raises(AuthenticationException):
        sandbox.commands.run("true", user="no-such-user")  # type: ignore[arg-type]


def test_connect_streams_output_from_now_on(sandbox) -> None:
    handle = sandbox.commands.run("echo early; sleep 1; echo late", background=True)
    for stdout, _, _ in handle:
        if stdout and "early" in stdout:
            break
    handle.disconnect()
    connected = sandbox.commands.connect(handle.pid)
    assert connected.pid == handle.pid
    result = connected.wait()
    assert "late\n" in result.stdout
    assert "early" not in result.stdout


def test_connect_to_unknown_pid_raises_not_found(sandbox) -> None:
    with pytest.raises(NotFoundException):
        sandbox.commands.connect(999999)


def test_connect_after_exit_replays_the_end(sandbox) -> None:
    handle = sandbox.commands.run("exit 7", background=True)
    handle.disconnect()
    deadline = time.monotonic() + 10
    while handle.pid in {p.pid for p in sandbox.commands.list()}:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(CommandExitException) as info:
        sandbox.commands.connect(handle.pid).wait()
    assert info.value.exit_code == 7


def test_utf8_sequence_split_at_the_end_becomes_replacement_char(sandbox) -> None:
    result = sandbox.commands.run("printf 'a%.0s' $(seq 8191); printf '\\xe2'")
    assert result.stdout == "a" * 8191 + "\ufffd"


def test_large_output_arrives_whole(sandbox) -> None:
    result = sandbox.commands.run("head -c 3000000 /dev/zero | tr '\\0' x")
    assert result.stdout == "x" * 3_000_000


def test_flooding_process_does_not_starve_other_clients(sandbox, sdk_env) -> None:
    from e2b import Sandbox

    flowing = threading.Event()
    flood_done = threading.Event()
    received: list[int] = [0]

    def count(chunk: str) -> None:
        received[0] += len(chunk)
        flowing.set()

    def flood() -> None:
        try:
            Sandbox.connect(sandbox.sandbox_id).commands.run(
                "yes | head -c 200M", on_stdout=count, retain_output=False, timeout=300)
        finally:
            flood_done.set()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        assert flowing.wait(30), "the flood never started"
        latencies = []
        while not flood_done.is_set():
            started = time.monotonic()
            assert sandbox.commands.run("echo ok").stdout == "ok\n"
            latencies.append(time.monotonic() - started)
    finally:
        thread.join(240)
    assert received[0] == 200 * 1024 * 1024
    assert len(latencies) >= 3, f"flood too short to interleave commands: {latencies}"
    # Noisy shared 2-core machine: a generous bound, far below "waits for the flood".
    assert sorted(latencies)[len(latencies) // 2] < 0.5, latencies


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.slow
def test_slow_reader_gets_backpressure_not_unbounded_buffering(sandbox, envd) -> None:
    handle = sandbox.commands.run("yes", background=True)
    try:
        before = _rss_bytes(envd.proc.pid)
        stream = iter(handle)
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            next(stream)
            time.sleep(0.05)
        grown = _rss_bytes(envd.proc.pid) - before
        # `yes` writes GB/s: buffering it for 2 s would grow envd by gigabytes.
        assert grown < 64 * 1024 * 1024, f"envd grew by {grown / 2**20:.0f} MiB"
    finally:
        sandbox.commands.kill(handle.pid)
