"""``aenv template``: build templates (from flags or a Dockerfile), list and remove them.

A build talks E2B's template API in the order ``Template.build`` does: ``POST
/v3/templates`` for the template and build ids; for each COPY, ``GET
/templates/{id}/files/{filesHash}`` and a PUT of the tar archive when the server does not
have it yet; ``POST /v2/templates/{id}/builds/{buildID}`` with the steps; then ``GET
.../status?logsOffset=N`` every fraction of a second, printing new log lines, until the
build is ready (exit 0) or failed (exit 1 with the server's reason).

With flags the steps run in a fixed order — ENV, WORKDIR, COPY, RUN, USER (installs as
root, then the sandbox user) — because a command line cannot say how ``--run`` and
``--copy`` interleave; a Dockerfile (``-f``) gives full control, and flags given with it
add steps after the Dockerfile's.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Collection
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..client.api import ApiClient
from ..client.build_files import BuildFilesError, files_hash, read_dockerignore, tar_archive
from ..config import Settings
from ..interpreter.template import NAME as INTERPRETER_TEMPLATE
from . import interpreter_template
from .connection import UrlOption, fail, session
from .dockerfile import DockerfileError, Recipe, parse_dockerfile
from .sandbox import pairs, relative_time

app = typer.Typer(no_args_is_help=True, help="Build, list and remove templates.")
# The SDK polls the build status every 0.2 s; the CLI is a person watching, 0.5 s is plenty.
POLL_INTERVAL_S = 0.5
DEFAULT_PARENT = "base"


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="template")


def recipe_from(dockerfile: Path | None, *, from_template: str | None, run: list[str],
                copy: list[str], env: dict[str, str], workdir: str | None, user: str | None,
                start_cmd: str | None, ready_cmd: str | None) -> Recipe:
    """The Dockerfile's recipe (if any) with the flags applied on top."""
    try:
        recipe = parse_dockerfile(dockerfile.read_text()) if dockerfile else Recipe()
    except DockerfileError as e:
        raise fail(str(e), 2) from None
    except OSError as e:
        raise fail(f"cannot read {dockerfile}: {e.strerror}", 2) from None
    if from_template:
        recipe.from_template = from_template
    if env:
        recipe.add("ENV", *(x for kv in env.items() for x in kv))
    if workdir:
        recipe.add("WORKDIR", workdir)
    for item in copy:
        src, sep, dest = item.partition(":")
        if not sep or not src or not dest:
            raise fail(f"invalid --copy '{item}': expected SRC:DEST", 2)
        recipe.add("COPY", src, dest, "", "")
    for cmd in run:
        recipe.add("RUN", cmd)
    if user:
        recipe.add("USER", user)
    if start_cmd:
        recipe.start_cmd = start_cmd
    if ready_cmd:
        recipe.ready_cmd = ready_cmd
    return recipe


def build_spec(recipe: Recipe, hashes: dict[int, str],
               templates: Collection[str] | None = None) -> dict[str, Any]:
    """TemplateBuildStartV2, with ``filesHash`` on the COPY steps (by step index). The
    parent is ``fromTemplate`` when ``templates`` (the server's ids and names; None: not
    asked) has it (or its name before a ``:tag``), else ``fromImage``: a Dockerfile's
    ``FROM`` may name either, and the server's templates win."""
    steps = []
    for i, step in enumerate(recipe.steps):
        s = {"type": step["type"], "args": step["args"], "force": False}
        if i in hashes:
            s["filesHash"] = hashes[i]
        steps.append(s)
    parent = recipe.from_template or DEFAULT_PARENT
    known = templates is None or parent in templates or parent.split(":")[0] in templates
    key = "fromTemplate" if known else "fromImage"
    spec: dict[str, Any] = {"steps": steps, "force": False, key: parent}
    if recipe.start_cmd:
        spec["startCmd"] = recipe.start_cmd
    if recipe.ready_cmd:
        spec["readyCmd"] = recipe.ready_cmd
    return spec


def _names(api: ApiClient) -> set[str]:
    """Every id, alias and name:tag the server's templates answer to."""
    out: set[str] = set()
    for t in api.list_templates():
        out.add(t.get("templateID", ""))
        for name in [*(t.get("aliases") or []), *(t.get("names") or [])]:
            out.update({name, name.split(":")[0]})
    return out


def _clock(ts: str | None) -> str:
    try:
        return datetime.fromisoformat(ts or "").astimezone().strftime("%H:%M:%S")
    except ValueError:
        return datetime.now().strftime("%H:%M:%S")


class BuildView:
    """The progress display: log lines scroll above a spinner naming the current step."""

    def __init__(self, console: Console, total_steps: int) -> None:
        self.console = console
        self.total = total_steps
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                 TimeElapsedColumn(), console=console, transient=True)
        self.task = self.progress.add_task("requesting the build")

    def __enter__(self) -> BuildView:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def phase(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def note(self, text: str) -> None:
        self.progress.console.print(Text(text, style="dim"))

    def log(self, entry: dict[str, Any]) -> None:
        step = entry.get("step")
        if step:
            label = f"step {step}/{self.total}" if step.isdigit() else step
            self.phase(f"building: {label}")
        style = "red" if entry.get("level") == "error" else ""  # "": rich's plain text
        prefix = f"{_clock(entry.get('timestamp'))} " + (f"[{step}] " if step else "")
        self.progress.console.print(Text(prefix, style="dim") +
                                    Text(str(entry.get("message", "")), style=style))


def _upload_copies(api: ApiClient, view: BuildView, template_id: str, recipe: Recipe,
                   hashes: dict[int, str], context: Path, ignore: list[str]) -> None:
    for i, files in hashes.items():
        src = recipe.steps[i]["args"][0]
        link = api.file_upload_link(template_id, files)
        if link.get("present") or not link.get("url"):
            view.note(f"'{src}' is already on the server")
            continue
        view.phase(f"uploading '{src}'")
        archive, size = tar_archive(src, context, ignore)
        with archive:
            api.upload_files(link["url"], archive, size, link.get("headers") or None)
        view.note(f"uploaded '{src}' ({size} bytes)")


def _wait(api: ApiClient, view: BuildView, template_id: str, build_id: str) -> dict[str, Any]:
    offset = 0
    while True:
        status = api.build_status(template_id, build_id, offset)
        entries = status.get("logEntries") or []
        for entry in entries:
            view.log(entry)
        offset += len(entries)
        if status.get("status") in ("ready", "error"):
            # A page holds at most 100 entries: drain the tail before reporting.
            while entries:
                more = api.build_status(template_id, build_id, offset)
                entries = more.get("logEntries") or []
                for entry in entries:
                    view.log(entry)
                offset += len(entries)
            return status
        time.sleep(POLL_INTERVAL_S)


@app.command()
def build(
    name: str = typer.Argument(..., help="Template name, optionally name:tag."),
    dockerfile: Path | None = typer.Option(None, "--file", "-f", help="Build from a Dockerfile."),
    context: Path | None = typer.Option(
        None, "--context", "-C",
        help="Directory COPY sources are relative to (default: the Dockerfile's, else .)."),
    from_template: str | None = typer.Option(None, "--from", help="Parent template "
                                             f"(default: FROM, else {DEFAULT_PARENT})."),
    run: list[str] = typer.Option([], "--run", metavar="CMD", help="RUN step (repeatable)."),
    copy: list[str] = typer.Option([], "--copy", metavar="SRC:DEST",
                                   help="COPY step (repeatable)."),
    env: list[str] = typer.Option([], "--env", "-e", metavar="KEY=VALUE",
                                  help="ENV for later steps and the sandboxes (repeatable)."),
    workdir: str | None = typer.Option(None, "--workdir", help="WORKDIR step."),
    user: str | None = typer.Option(None, "--user", help="USER step (the sandbox's user)."),
    start_cmd: str | None = typer.Option(None, "--start-cmd",
                                         help="Command started in every sandbox."),
    ready_cmd: str | None = typer.Option(None, "--ready-cmd",
                                         help="Exits 0 once the start command is ready."),
    cpu: int | None = typer.Option(None, "--cpu", min=1, help="vCPUs of its sandboxes."),
    memory_mb: int | None = typer.Option(None, "--memory-mb", min=128,
                                         help="Memory (MiB) of its sandboxes."),
    url: str | None = UrlOption,
) -> None:
    """Build a template and print its id. ``code-interpreter-v1`` alone (no Dockerfile,
    no steps) builds the definition aenv ships (aenv/interpreter/template.py)."""
    shipped = name.split(":")[0] == INTERPRETER_TEMPLATE and not any(
        (dockerfile, context, from_template, run, copy, env, workdir, user, start_cmd, ready_cmd))
    if shipped:
        console = Console(stderr=True, highlight=False)
        started = time.monotonic()
        with console.status("installing the code interpreter's libraries for the guest"):
            try:
                context = interpreter_template.stage(Settings.from_env().cache_dir)
            except (RuntimeError, OSError) as e:
                raise fail(str(e)) from None
        console.print(f"libraries staged in {context} ({time.monotonic() - started:.1f}s)")
        recipe = interpreter_template.recipe()
    else:
        recipe = recipe_from(dockerfile, from_template=from_template, run=run, copy=copy,
                             env=pairs(env, "environment variable"), workdir=workdir,
                             user=user, start_cmd=start_cmd, ready_cmd=ready_cmd)
    ctx_dir = context or (dockerfile.parent if dockerfile else Path("."))
    ignore = read_dockerignore(ctx_dir)
    try:
        hashes = {i: files_hash(s["args"][0], s["args"][1], ctx_dir, ignore)
                  for i, s in enumerate(recipe.steps) if s["type"] == "COPY"}
    except BuildFilesError as e:
        raise fail(str(e), 2) from None
    started = time.monotonic()
    console = Console(stderr=True, highlight=False)
    with session(url) as api, BuildView(console, len(recipe.steps)) as view:
        res = api.request_build(name, cpu_count=cpu, memory_mb=memory_mb)
        template_id, build_id = res["templateID"], res["buildID"]
        view.note(f"template {template_id}, build {build_id}")
        _upload_copies(api, view, template_id, recipe, hashes, ctx_dir, ignore)
        view.phase("starting the build")
        api.start_build(template_id, build_id, build_spec(recipe, hashes, _names(api)))
        view.phase("building")
        status = _wait(api, view, template_id, build_id)
    took = time.monotonic() - started
    if status.get("status") != "ready":
        reason = status.get("reason") or {}
        step = f" at step {reason['step']}" if reason.get("step") else ""
        raise fail(f"build of {name} failed{step}: {reason.get('message', 'unknown error')}")
    console.print(f"[green]built[/] {name} ({template_id}) in {took:.1f}s")
    sys.stdout.write(template_id + "\n")


@app.command("ls")
def list_(as_json: bool = typer.Option(False, "--json", help="Print the list as JSON."),
          url: str | None = UrlOption) -> None:
    """List templates."""
    with session(url) as api:
        items = api.list_templates()
    if as_json:
        sys.stdout.write(json.dumps(items, indent=2) + "\n")
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("ID", "NAMES", "STATUS", "CPU/MEM", "DISK", "BUILDS", "SANDBOXES", "UPDATED"):
        table.add_column(col, no_wrap=col != "NAMES", overflow="fold")
    now = datetime.now(UTC)
    for t in items:
        table.add_row(
            t["templateID"], ", ".join(t.get("names") or t.get("aliases") or []),
            t.get("buildStatus", ""), f"{t.get('cpuCount', '?')}/{t.get('memoryMB', '?')}M",
            f"{t.get('diskSizeMB', '?')}M", str(t.get("buildCount", "")),
            str(t.get("spawnCount", "")), relative_time(t.get("updatedAt"), now))
    if items:
        Console().print(table)
    else:
        Console(stderr=True).print("no templates")


@app.command("rm")
def remove(name: str = typer.Argument(..., help="Template id or name."),
           url: str | None = UrlOption) -> None:
    """Delete a template."""
    with session(url) as api:
        api.delete_template(name)
