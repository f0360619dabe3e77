"""A Dockerfile as template build steps: the subset that maps onto E2B's template API.

``FROM`` names the parent: a template of the server, or else an image in a registry
(``aenv template build`` asks the server which; ``cli/template.build_spec``),
``RUN``/``ENV``/``ARG``/``WORKDIR``/``USER``/``COPY``/``ADD`` become steps in order, and
``CMD``/``ENTRYPOINT`` become the start command, combined as Docker combines them.
``EXPOSE``, ``VOLUME``, ``LABEL`` and ``MAINTAINER`` are metadata and are skipped. Anything
else (multi-stage builds, heredocs, ``RUN --mount``, ``ADD <url>``, ``HEALTHCHECK``, ...)
is refused with the line number rather than silently built differently.

Steps are written as the SDK writes them: ``RUN [cmd]``, ``ENV [k1, v1, k2, v2]``,
``WORKDIR [path]``, ``USER [name]``, ``COPY [src, dest, owner, mode]`` with owner and
octal mode (``"0755"``) empty when not given. ``$VAR`` references are passed on as
written, as the SDK does.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

_IGNORED = {"EXPOSE", "VOLUME", "LABEL", "MAINTAINER"}
_CHMOD = re.compile(r"^[0-7]{3,4}$")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
_HEREDOC = re.compile(r"<<-?\s*['\"]?[A-Za-z_]")


class DockerfileError(Exception):
    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(f"Dockerfile line {line}: {message}" if line else message)
        self.line = line


@dataclass
class Recipe:
    """What a template build sends: the parent template, the steps, the start command."""

    from_template: str | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    start_cmd: str | None = None
    ready_cmd: str | None = None

    def add(self, kind: str, *args: str) -> None:
        self.steps.append({"type": kind, "args": list(args)})


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction text) with continuations joined and comments
    (including comment lines inside a continuation) dropped."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf.append(stripped[:-1])
            continue
        buf.append(stripped)
        out.append((start, " ".join(part.strip() for part in buf if part.strip())))
        buf = []
    if buf:
        out.append((start, " ".join(part.strip() for part in buf if part.strip())))
    return out


def _exec_form(rest: str) -> list[str] | None:
    if not rest.startswith("["):
        return None
    try:
        value = json.loads(rest)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def _words(rest: str, line: int) -> list[str]:
    try:
        return shlex.split(rest)
    except ValueError as e:
        raise DockerfileError(str(e), line) from None


def _flags(rest: str, allowed: set[str], line: int, what: str) -> tuple[dict[str, str], str]:
    """Leading ``--name[=value]`` flags (only ``allowed`` ones) and the text after them."""
    flags: dict[str, str] = {}
    rest = rest.strip()
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        rest = rest.lstrip()
        name, _, value = word[2:].partition("=")
        if name not in allowed:
            raise DockerfileError(f"{what} --{name} is not supported", line)
        flags[name] = value
    return flags, rest


@dataclass
class _Start:
    exec_form: bool
    args: list[str]


def _start_command(entrypoint: _Start | None, cmd: _Start | None) -> str | None:
    """Docker's rules: an exec-form ENTRYPOINT gets CMD appended (a shell-form CMD as
    ``/bin/sh -c``), a shell-form ENTRYPOINT ignores CMD, else CMD alone."""
    if entrypoint is not None:
        if not entrypoint.exec_form:
            return entrypoint.args[0] if entrypoint.args else None
        words = list(entrypoint.args)
        if cmd is not None:
            words += cmd.args if cmd.exec_form else ["/bin/sh", "-c", *cmd.args[:1]]
        return shlex.join(words) if words else None
    if cmd is not None:
        if cmd.exec_form:
            return shlex.join(cmd.args) if cmd.args else None
        return cmd.args[0] if cmd.args else None
    return None


def parse_dockerfile(text: str) -> Recipe:
    recipe = Recipe()
    entrypoint: _Start | None = None
    cmd: _Start | None = None
    seen_from = False
    for line, instruction in _logical_lines(text):
        name, *tail = instruction.split(None, 1)
        name, rest = name.upper(), (tail[0].strip() if tail else "")
        if _HEREDOC.search(rest) and name in ("RUN", "COPY", "ADD"):
            raise DockerfileError("heredocs are not supported", line)
        if name == "FROM":
            if seen_from:
                raise DockerfileError("multi-stage Dockerfiles are not supported", line)
            seen_from = True
            _, rest = _flags(rest, set(), line, "FROM")
            words = _words(rest, line)
            if len(words) not in (1, 3) or (len(words) == 3 and words[1].lower() != "as"):
                raise DockerfileError("FROM takes a template or image name (and optionally "
                                      "AS name)", line)
            recipe.from_template = words[0]
            continue
        if not seen_from and name != "ARG":
            raise DockerfileError(f"{name} before FROM", line)
        if name == "RUN":
            _, rest = _flags(rest, set(), line, "RUN")
            exec_args = _exec_form(rest)
            if exec_args is not None:
                recipe.add("RUN", shlex.join(exec_args))
            elif rest:
                recipe.add("RUN", rest)
            else:
                raise DockerfileError("RUN needs a command", line)
        elif name in ("ENV", "ARG"):
            recipe.add("ENV", *_env_args(name, rest, line))
        elif name in ("WORKDIR", "USER"):
            words = _words(rest, line)
            if len(words) != 1:
                raise DockerfileError(f"{name} takes exactly one argument", line)
            recipe.add(name, words[0])
        elif name in ("COPY", "ADD"):
            _copy(recipe, name, rest, line)
        elif name in ("CMD", "ENTRYPOINT"):
            exec_args = _exec_form(rest)
            start = _Start(True, exec_args) if exec_args is not None else _Start(False, [rest])
            if name == "CMD":
                cmd = start
            else:
                entrypoint = start
        elif name not in _IGNORED:
            raise DockerfileError(f"{name} is not supported", line)
    if not seen_from:
        raise DockerfileError("the Dockerfile has no FROM")
    recipe.start_cmd = _start_command(entrypoint, cmd)
    return recipe


def _env_args(name: str, rest: str, line: int) -> list[str]:
    words = _words(rest, line)
    if not words:
        raise DockerfileError(f"{name} needs at least one variable", line)
    args: list[str] = []
    if name == "ENV" and "=" not in words[0]:
        # Legacy form: ENV KEY value with spaces
        key, _, value = rest.partition(" ")
        return [key, " ".join(_words(value, line))]
    for word in words:
        key, sep, value = word.partition("=")
        if not key:
            raise DockerfileError(f"{name} names can not be blank", line)
        if name == "ENV" and not sep:
            raise DockerfileError(f"ENV {word}: expected KEY=VALUE", line)
        args += [key, value]
    return args


def _copy(recipe: Recipe, name: str, rest: str, line: int) -> None:
    flags, rest = _flags(rest, {"chown", "chmod", "from"}, line, name)
    if "from" in flags:
        raise DockerfileError(f"{name} --from is not supported (no multi-stage builds)", line)
    exec_args = _exec_form(rest)
    words = exec_args if exec_args is not None else _words(rest, line)
    if len(words) < 2:
        raise DockerfileError(f"{name} needs a source and a destination", line)
    mode = flags.get("chmod", "")
    if mode and not _CHMOD.match(mode):
        raise DockerfileError(f"invalid --chmod '{mode}': expected an octal mode", line)
    mode = f"{int(mode, 8):04o}" if mode else ""
    *sources, dest = words
    for src in sources:
        if name == "ADD" and _URL.match(src):
            raise DockerfileError("ADD from a URL is not supported", line)
        recipe.add("COPY", src, dest, flags.get("chown", ""), mode)
