"""``sandbox.pty`` through the real (sync) E2B SDK: a real pseudo-terminal per shell."""

from __future__ import annotations

import pytest
from e2b import CommandExitException, SandboxException
from e2b.sandbox.commands.command_handle import PtySize

DEFAULT_SIZE = PtySize(rows=24, cols=80)


def run_in_pty(sandbox, script: bytes, size: PtySize = DEFAULT_SIZE, **kw) -> tuple[bytes, int]:
    """Type ``script`` into a fresh PTY shell and collect everything until it exits."""
    handle = sandbox.pty.create(size, **kw)
    sandbox.pty.send_stdin(handle.pid, script)
    out = bytearray()
    result = handle.wait(on_pty=out.extend)
    return bytes(out), result.exit_code


def test_shell_sees_envs_and_exit_ends_it_with_zero(sandbox) -> None:
    out, code = run_in_pty(sandbox, b"echo $ABC\nexit\n", envs={"ABC": "123"})
    assert b"123" in out
    assert code == 0


def test_initial_size_comes_from_the_request(sandbox) -> None:
    out, _ = run_in_pty(sandbox, b"stty size\nexit\n", size=PtySize(rows=33, cols=77))
    assert b"33 77" in out


def test_resize_changes_tput_cols(sandbox) -> None:
    handle = sandbox.pty.create(DEFAULT_SIZE)
    sandbox.pty.resize(handle.pid, PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(handle.pid, b"tput cols\nexit\n")
    out = bytearray()
    handle.wait(on_pty=out.extend)
    assert b"100\r\n" in out


def test_shell_is_a_session_leader_with_a_controlling_tty(sandbox) -> None:
    script = (b"[ \"$(cut -d' ' -f6 /proc/$$/stat)\" = $$ ] && echo LEADER-OK; "
              b"(exec 3</dev/tty) && echo CTTY-OK\nexit\n")
    out, _ = run_in_pty(sandbox, script)
    assert b"LEADER-OK" in out
    assert b"CTTY-OK" in out


def test_shell_runs_as_the_requested_user(sandbox) -> None:
    out, _ = run_in_pty(sandbox, b"echo I-AM-$(whoami)\nexit\n", user="root")
    assert b"I-AM-root" in out


def test_kill_reaps_the_shell_at_once(sandbox) -> None:
    handle = sandbox.pty.create(DEFAULT_SIZE)
    assert sandbox.pty.kill(handle.pid) is True
    alive = sandbox.commands.run(f"kill -0 {handle.pid} 2>/dev/null && echo yes || echo no",
                                 user="root")
    assert alive.stdout == "no\n"
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == -1


def test_connect_after_disconnect_gets_new_output_of_the_same_pid(sandbox) -> None:
    handle = sandbox.pty.create(DEFAULT_SIZE)
    handle.disconnect()
    connected = sandbox.pty.connect(handle.pid)
    assert connected.pid == handle.pid
    sandbox.pty.send_stdin(handle.pid, b"echo AFTER-$((40+2))\nexit\n")
    out = bytearray()
    assert connected.wait(on_pty=out.extend).exit_code == 0
    assert b"AFTER-42" in out


def test_stdin_input_to_a_pty_process_is_refused(sandbox) -> None:
    handle = sandbox.pty.create(DEFAULT_SIZE)
    try:
        with pytest.raises(SandboxException, match="tty assigned to process"):
            sandbox.commands.send_stdin(handle.pid, "x")
    finally:
        sandbox.pty.kill(handle.pid)


def test_close_stdin_of_a_pty_process_is_refused(sandbox) -> None:
    handle = sandbox.pty.create(DEFAULT_SIZE)
    try:
        with pytest.raises(SandboxException, match="cannot close stdin for PTY"):
            sandbox.commands.close_stdin(handle.pid)
    finally:
        sandbox.pty.kill(handle.pid)


def test_pty_stream_input_reaches_the_shell(sandbox) -> None:
    handle = sandbox.pty.create(DEFAULT_SIZE)
    sandbox.pty.stream_input(handle.pid, [b"echo STREAMED-", b"$((1+1))\n", b"exit\n"])
    out = bytearray()
    assert handle.wait(on_pty=out.extend).exit_code == 0
    assert b"STREAMED-2" in out
