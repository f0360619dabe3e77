"""``aenv sandbox``: create, list, exec into, shell into, pause, resume and kill sandboxes.

Everything goes through the server's public surface, like any E2B client: lifecycle over
the REST API, commands and shells over the sandbox proxy to the sandbox's envd (routing
headers plus the sandbox's envd access token, read from ``GET /sandboxes/{id}``). Never
the store, never a driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from datetime import UTC, datetime
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from ..client.api import ApiClient
from ..client.envd import EnvdClient, EnvdError
from .connection import UrlOption, fail, session, stderr
from .shell import exit_status, run_shell

app = typer.Typer(no_args_is_help=True, help="Create, list, use and remove sandboxes.")
# Failures of exec/shell themselves (not of the remote command) exit 255, as ssh does.
EXEC_ERROR_STATUS = 255
# A command killed at its --timeout, as timeout(1) reports it.
TIMEOUT_STATUS = 124


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="sandbox")


def pairs(items: list[str], what: str) -> dict[str, str]:
    """``["k=v", ...]`` -> ``{"k": "v"}``; a malformed item is a usage error."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise fail(f"invalid {what} '{item}': expected KEY=VALUE", 2)
        out[key] = value
    return out


def relative_time(ts: str | None, now: datetime) -> str:
    """RFC 3339 -> "3m ago" / "in 4m 10s"."""
    if not ts:
        return "-"
    try:
        t = datetime.fromisoformat(ts)
    except ValueError:
        return ts
    delta = int((t - now).total_seconds())
    span = abs(delta)
    if span < 1:
        return "now"
    if span < 60:
        text = f"{span}s"
    elif span < 3600:
        text = f"{span // 60}m {span % 60}s" if span < 600 else f"{span // 60}m"
    elif span < 86400:
        text = f"{span // 3600}h {span % 3600 // 60}m"
    else:
        text = f"{span // 86400}d {span % 86400 // 3600}h"
    return f"in {text}" if delta >= 0 else f"{text} ago"


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@app.command()
def create(
    template: str = typer.Argument("base", help="Template id or name."),
    timeout: int | None = typer.Option(
        None, "--timeout", min=0, help="Seconds to live (default: the server's, 300)."),
    metadata: list[str] = typer.Option([], "--metadata", "-m", metavar="KEY=VALUE",
                                       help="Metadata to tag the sandbox with (repeatable)."),
    env: list[str] = typer.Option([], "--env", "-e", metavar="KEY=VALUE",
                                  help="Environment variable for every command (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the server's answer as JSON."),
    url: str | None = UrlOption,
) -> None:
    """Create a sandbox and print its id."""
    meta, envs = pairs(metadata, "metadata"), pairs(env, "environment variable")
    with session(url) as api:
        sbx = api.create_sandbox(template, timeout=timeout, metadata=meta, env_vars=envs)
    if as_json:
        _print_json(sbx)
    else:
        sys.stdout.write(sbx["sandboxID"] + "\n")


@app.command("ls")
def list_(
    state: list[str] = typer.Option([], "--state", "-s", metavar="running|paused",
                                    help="Only sandboxes in this state (repeatable)."),
    metadata: list[str] = typer.Option([], "--metadata", "-m", metavar="KEY=VALUE",
                                       help="Only sandboxes with this metadata (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the list as JSON."),
    url: str | None = UrlOption,
) -> None:
    """List live sandboxes, newest first."""
    states = [s.strip() for item in state for s in item.split(",") if s.strip()]
    meta = pairs(metadata, "metadata")
    with session(url) as api:
        items = api.list_sandboxes(states=states or None, metadata=meta or None)
    if as_json:
        _print_json(items)
        return
    now = datetime.now(UTC)
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("ID", no_wrap=True, min_width=20)
    table.add_column("TEMPLATE", overflow="fold")
    table.add_column("STATE", no_wrap=True)
    table.add_column("STARTED", no_wrap=True)
    table.add_column("ENDS", no_wrap=True)
    table.add_column("CPU/MEM", no_wrap=True)
    table.add_column("METADATA", overflow="fold")
    for s in items:
        table.add_row(
            s["sandboxID"], s.get("alias") or s["templateID"], s["state"],
            relative_time(s.get("startedAt"), now), relative_time(s.get("endAt"), now),
            f"{s.get('cpuCount', '?')}/{s.get('memoryMB', '?')}M",
            " ".join(f"{k}={v}" for k, v in (s.get("metadata") or {}).items()))
    if items:
        Console().print(table)
    else:
        Console(stderr=True).print("no sandboxes")


@app.command()
def kill(sandbox_id: str = typer.Argument(..., metavar="ID"),
         url: str | None = UrlOption) -> None:
    """Kill a sandbox (running or paused); its disk is discarded."""
    with session(url) as api:
        api.kill_sandbox(sandbox_id)


app.command("rm", help="Kill a sandbox (alias of kill).")(kill)


@app.command()
def pause(sandbox_id: str = typer.Argument(..., metavar="ID"),
          url: str | None = UrlOption) -> None:
    """Pause a sandbox (memory and disk kept); `resume` brings it back."""
    with session(url) as api:
        api.pause_sandbox(sandbox_id)


@app.command()
def resume(
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    timeout: int | None = typer.Option(None, "--timeout", min=0,
                                       help="Seconds to live from now on."),
    url: str | None = UrlOption,
) -> None:
    """Resume a paused sandbox (E2B's v2 connect; a running one just stays running)."""
    with session(url) as api:
        _, resumed = api.connect_sandbox(sandbox_id, timeout)
    Console(stderr=True).print("resumed" if resumed else "already running")


@app.command()
def fork(
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    count: int = typer.Option(1, "--count", "-n", min=1, help="How many children."),
    timeout: int | None = typer.Option(None, "--timeout", min=0,
                                       help="Children's TTL in seconds (default: the source's)."),
    json_out: bool = typer.Option(False, "--json", help="Print the API's answer as JSON."),
    url: str | None = UrlOption,
) -> None:
    """Fork a running sandbox into COUNT children that start from its current state."""
    with session(url) as api:
        results = api.fork_sandbox(sandbox_id, count, timeout)
    if json_out:
        typer.echo(json.dumps(results))
    failed = 0
    for r in results:
        if "sandbox" in r:
            if not json_out:
                typer.echo(r["sandbox"]["sandboxID"])
        else:
            failed += 1
            err = r.get("error") or {}
            Console(stderr=True).print(f"[red]child failed:[/] {err.get('code')} "
                                       f"{err.get('message')}")
    if failed:
        raise typer.Exit(1)


@app.command()
def snapshot(
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    name: str | None = typer.Option(None, "--name", help="A name to create sandboxes from."),
    url: str | None = UrlOption,
) -> None:
    """Take a persistent snapshot of a running sandbox (it keeps running); prints its id,
    which `aenv sandbox create` accepts as a template."""
    with session(url) as api:
        info = api.snapshot_sandbox(sandbox_id, name)
    typer.echo(info["snapshotID"])


def _envd_for(api: ApiClient, sandbox_id: str) -> EnvdClient:
    info = api.get_sandbox(sandbox_id)
    if info.get("state") == "paused":
        raise fail(f"sandbox '{sandbox_id}' is paused: `aenv sandbox resume {sandbox_id}` "
                   "first", EXEC_ERROR_STATUS)
    return EnvdClient.through_proxy(api.url, sandbox_id, info.get("envdAccessToken"))


CTRL_C_KILL_TIMEOUT_S = 5.0  # how long Ctrl-C on exec waits for the remote kill


@app.command("exec")
def exec_(
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    command: list[str] = typer.Argument(..., metavar="-- CMD...",
                                        help="Command line, run by bash -l -c as ssh does."),
    user: str | None = typer.Option(None, "--user", "-u", help="Run as this user."),
    cwd: str | None = typer.Option(None, "--cwd", "-w", help="Working directory."),
    env: list[str] = typer.Option([], "--env", "-e", metavar="KEY=VALUE",
                                  help="Environment variable (repeatable)."),
    timeout: float | None = typer.Option(
        None, "--timeout", min=0,
        help="Kill the command after this many seconds and exit 124 (default: no limit)."),
    url: str | None = UrlOption,
) -> None:
    """Run a command in a sandbox, streaming its output; exits with its status."""
    envs = pairs(env, "environment variable")
    line = " ".join(command)
    with session(url, error_status=EXEC_ERROR_STATUS) as api:
        envd = _envd_for(api, sandbox_id)
        try:
            status = asyncio.run(_exec(envd, line, user=user, cwd=cwd, envs=envs,
                                       timeout=timeout or None))
        except KeyboardInterrupt:
            status = 130
    raise typer.Exit(status)


async def _exec(envd: EnvdClient, line: str, *, user: str | None, cwd: str | None,
                envs: dict[str, str], timeout: float | None) -> int:
    out, err = sys.stdout.buffer, sys.stderr.buffer
    pid = 0
    try:
        events = envd.start("/bin/bash", ["-l", "-c", line], user=user, cwd=cwd, envs=envs,
                            stdin=False, timeout=timeout)
        async with contextlib.aclosing(events):
            try:
                async for event in events:
                    if event.kind == "start":
                        pid = event.pid
                    elif event.kind in ("stdout", "stderr"):
                        stream = out if event.kind == "stdout" else err
                        stream.write(event.data)
                        stream.flush()
                    elif event.kind == "end":
                        return exit_status(event)
            except EnvdError as e:
                if e.code != "deadline_exceeded" or timeout is None:
                    raise
                # envd killed it at the deadline; report it the way timeout(1) does.
                stderr.print(f"[bold red]error:[/] the command ran out of its {timeout:g}s "
                             "and was killed")
                return TIMEOUT_STATUS
            except asyncio.CancelledError:
                # Ctrl-C: do not leave the command running in the sandbox, but do not hang
                # on a sandbox that is slow to answer either.
                if pid:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(envd.kill(pid), CTRL_C_KILL_TIMEOUT_S)
                raise
    finally:
        await envd.aclose()
    raise AssertionError("unreachable: start() raises when the stream has no end event")


@app.command()
def shell(
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    user: str | None = typer.Option(None, "--user", "-u", help="Log in as this user."),
    cwd: str | None = typer.Option(None, "--cwd", "-w", help="Start in this directory."),
    env: list[str] = typer.Option([], "--env", "-e", metavar="KEY=VALUE",
                                  help="Environment variable (repeatable)."),
    url: str | None = UrlOption,
) -> None:
    """Open an interactive shell (a PTY) in a sandbox; exits with the shell's status."""
    envs = pairs(env, "environment variable")
    with session(url, error_status=EXEC_ERROR_STATUS) as api:
        envd = _envd_for(api, sandbox_id)
        status = asyncio.run(_shell(envd, user=user, cwd=cwd, envs=envs))
    raise typer.Exit(status)


async def _shell(envd: EnvdClient, **kwargs: Any) -> int:
    try:
        return await run_shell(envd, **kwargs)
    finally:
        await envd.aclose()
