"""``aenv sandbox``: lifecycle, exec and error reporting against a live aenv server."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT, free_port

from .conftest import Aenv


def listed(aenv: Aenv, *args: str) -> dict[str, dict]:
    result = aenv("sandbox", "ls", "--json", *args)
    assert result.exit_code == 0, result.output
    return {s["sandboxID"]: s for s in json.loads(result.stdout)}


def test_create_prints_an_id_that_ls_shows(aenv: Aenv, sandbox_id: str) -> None:
    assert sandbox_id.isalnum()
    entry = listed(aenv)[sandbox_id]
    assert entry["state"] == "running"
    assert entry["metadata"] == {"suite": "cli"}
    table = aenv("sandbox", "ls")
    assert table.exit_code == 0
    assert sandbox_id in table.stdout and "suite=cli" in table.stdout


def test_create_json_answers_the_server_reply(aenv: Aenv) -> None:
    result = aenv("sandbox", "create", "base", "--json", "--timeout", "60", "-e", "A=1")
    assert result.exit_code == 0, result.output
    sbx = json.loads(result.stdout)
    assert sbx["templateID"] == "base" and sbx["envdAccessToken"]
    assert aenv("sandbox", "kill", sbx["sandboxID"]).exit_code == 0


def test_ls_filters_by_metadata_and_state(aenv: Aenv, sandbox_id: str) -> None:
    assert sandbox_id in listed(aenv, "--metadata", "suite=cli")
    assert sandbox_id not in listed(aenv, "--metadata", "suite=other")
    assert sandbox_id in listed(aenv, "--state", "running")
    assert sandbox_id not in listed(aenv, "--state", "paused")


def test_exec_streams_the_commands_output(aenv: Aenv, sandbox_id: str) -> None:
    result = aenv("sandbox", "exec", sandbox_id, "--", "echo", "hi")
    assert result.exit_code == 0, result.output
    assert result.stdout == "hi\n"


def test_exec_exits_with_the_commands_status(aenv: Aenv, sandbox_id: str) -> None:
    result = aenv("sandbox", "exec", sandbox_id, "--", "echo oops >&2; exit 3")
    assert result.exit_code == 3
    assert result.stdout == ""
    assert result.stderr == "oops\n"


def test_exec_takes_user_cwd_and_env(aenv: Aenv, sandbox_id: str) -> None:
    result = aenv("sandbox", "exec", sandbox_id, "--user", "root", "--cwd", "/tmp",
                  "--env", "GREETING=hello there", "--",
                  'echo "$(whoami) $(pwd) $GREETING"')
    assert result.exit_code == 0, result.output
    assert result.stdout == "root /tmp hello there\n"


def test_exec_timeout_kills_the_command(aenv: Aenv, sandbox_id: str) -> None:
    result = aenv("sandbox", "exec", sandbox_id, "--timeout", "1", "--", "sleep 30")
    assert result.exit_code == 124, (result.stdout, result.stderr)
    assert "ran out of its 1s" in result.stderr


def test_kill_removes_the_sandbox_from_ls(aenv: Aenv, sandbox_id: str) -> None:
    assert aenv("sandbox", "kill", sandbox_id).exit_code == 0
    assert sandbox_id not in listed(aenv)


def test_rm_is_kill(aenv: Aenv, sandbox_id: str) -> None:
    assert aenv("sandbox", "rm", sandbox_id).exit_code == 0
    assert sandbox_id not in listed(aenv)


def test_exec_on_a_killed_sandbox_is_one_clear_line(aenv: Aenv, sandbox_id: str) -> None:
    aenv("sandbox", "kill", sandbox_id)
    result = aenv("sandbox", "exec", sandbox_id, "--", "true")
    assert result.exit_code == 255
    assert result.stderr.strip() == f"error: sandbox '{sandbox_id}' not found (404)"


def test_kill_of_an_unknown_sandbox_is_one_line(aenv: Aenv) -> None:
    result = aenv("sandbox", "kill", "nosuchsandbox")
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: sandbox 'nosuchsandbox' not found (404)"


def test_resume_of_a_running_sandbox_says_so(aenv: Aenv, sandbox_id: str) -> None:
    result = aenv("sandbox", "resume", sandbox_id)
    assert result.exit_code == 0
    assert result.stderr.strip() == "already running"


def test_bad_key_is_a_clear_error(aenv: Aenv, monkeypatch) -> None:
    monkeypatch.setenv("AENV_API_KEY", "e2b_" + "0" * 40)
    result = aenv("sandbox", "ls")
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "API key rejected" in lines[0] and "401" in lines[0]
    assert "Traceback" not in result.output


def test_unreachable_server_is_a_clear_error(aenv: Aenv) -> None:
    result = aenv("sandbox", "ls", "--url", f"http://127.0.0.1:{free_port()}")
    assert result.exit_code == 1
    assert "cannot reach the aenv server" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_malformed_pairs_are_usage_errors(aenv: Aenv) -> None:
    result = aenv("sandbox", "create", "--metadata", "novalue")
    assert result.exit_code == 2
    assert "expected KEY=VALUE" in result.stderr


def test_key_is_read_from_the_local_servers_file(aenv: Aenv, cli_env, monkeypatch,
                                                 server) -> None:
    monkeypatch.delenv("AENV_API_KEY")
    secrets = Path(cli_env["AENV_HOME"]) / "secrets"
    secrets.mkdir(parents=True)
    (secrets / "api-key").write_text(server.server.api_key + "\n")
    assert aenv("sandbox", "ls").exit_code == 0


def test_e2b_api_url_is_the_fallback_server_url(aenv: Aenv, cli_env, monkeypatch) -> None:
    monkeypatch.delenv("AENV_URL")
    monkeypatch.setenv("E2B_API_URL", cli_env["AENV_URL"])
    assert aenv("sandbox", "ls").exit_code == 0
    monkeypatch.setenv("AENV_URL", "http://127.0.0.1:1")
    assert "cannot reach" in aenv("sandbox", "ls").stderr


def test_a_refused_pause_is_one_line(aenv: Aenv, sandbox_id: str) -> None:
    # The test server's process sandboxes cannot pause, so the server refuses it.
    result = aenv("sandbox", "pause", sandbox_id)
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1


def test_ctrl_c_on_exec_kills_the_remote_command(aenv: Aenv, cli_env, sandbox_id: str) -> None:
    pidfile = f"/tmp/aenv-cli-ctrl-c-{secrets.token_hex(4)}"
    # SIGINT as a terminal's Ctrl-C finds it: a run started in the background (``make test
    # &``, nohup) hands its children SIGINT ignored, and Python then leaves it so.
    proc = subprocess.Popen([sys.executable, "-c", "import signal; signal.signal("
                             "signal.SIGINT, signal.default_int_handler); "
                             "from aenv.cli.main import app; app()",
                             "sandbox", "exec", sandbox_id, "--",
                             f"echo $$ > {pidfile}; exec sleep 30"],
                            cwd=ROOT, env={**os.environ, **cli_env})
    try:
        deadline = time.monotonic() + 15
        while not (pid := aenv("sandbox", "exec", sandbox_id, "--",
                               f"cat {pidfile} 2>/dev/null").stdout.strip()):
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130  # the remote kill is bounded (5 s)
    finally:
        proc.kill()
        proc.wait()
        aenv("sandbox", "exec", sandbox_id, "--", f"rm -f {pidfile}")
    assert aenv("sandbox", "exec", sandbox_id, "--", f"kill -0 {pid}").exit_code != 0
