"""Readers for the deployment files, for tests that check what can be checked without a
Docker engine, a cluster or systemd as PID 1: a systemd unit parser, a Dockerfile
instruction reader, Docker's ignore-file matching, and the project's own facts
(version, console scripts, the variables aenv reads) to check the files against.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "aenv.service"
ENV_TEMPLATE = DEPLOY / "systemd" / "aenv.env"
INSTALL = DEPLOY / "systemd" / "install.sh"
HOST_PACKAGES = DEPLOY / "host-packages.sh"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKERIGNORE = DEPLOY / "docker" / "Dockerfile.dockerignore"
COMPOSE = DEPLOY / "docker-compose.yml"
K8S = DEPLOY / "k8s"
DRAIN = DEPLOY / "bin" / "aenv-drain"
INSTALL_DOC = ROOT / "docs" / "install.md"


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def image_ref() -> str:
    """The image every deployment file and the docs must name: ``aenv:<version>``."""
    return f"aenv:{pyproject()['project']['version']}"


def variables_aenv_reads() -> set[str]:
    """Every ``AENV_*`` variable aenv.config declares (server and client settings)."""
    from aenv.config import ClientSettings, Settings

    return {n for cls in (Settings, ClientSettings) for _, var in cls.variables()
            for n in var.names if n.startswith("AENV_")}


def env_file_names(path: Path) -> set[str]:
    """Variable names a KEY=VALUE file sets or shows commented out (``#KEY=``)."""
    return set(re.findall(r"^#?([A-Z][A-Z0-9_]*)=", path.read_text(), re.MULTILINE))


def setup_sh_packages() -> list[str]:
    """scripts/setup.sh's APT_PACKAGES, read independently of deploy/host-packages.sh."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    block = re.search(r"^APT_PACKAGES=\((.*?)^\)", text, re.MULTILINE | re.DOTALL)
    assert block, "scripts/setup.sh has no APT_PACKAGES=( ... ) block"
    return [w for line in block.group(1).splitlines()
            for w in line.split("#")[0].split()]


# -- systemd ----------------------------------------------------------------------------

def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections of a unit file → key → values in order (systemd allows repeated keys)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"key outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


# -- Dockerfile -------------------------------------------------------------------------

@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continuation"
    return out


def copy_sources(ins: Instruction) -> list[str]:
    """Source paths of a COPY (the last word is the destination; flags are skipped)."""
    if ins.args.startswith("["):
        words = json.loads(ins.args)
    else:
        words = [w for w in ins.args.split() if not w.startswith("--")]
    return words[:-1]


def exec_form(ins: Instruction) -> list[str]:
    """The JSON-array form of ENTRYPOINT/CMD (shell form is refused: signals)."""
    value = json.loads(ins.args)
    assert isinstance(value, list) and all(isinstance(w, str) for w in value)
    return value


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def dockerignore_admits(ignore_text: str, path: str) -> bool:
    """Whether Docker's ignore rules let ``path`` (relative to the context) into the
    context: patterns apply in order, the last match wins, ``!`` re-admits, and a pattern
    matching a parent directory matches everything below it."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    admitted = True
    for raw in ignore_text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        regex = _ignore_regex(pattern.strip("/"))
        if any(regex.fullmatch(p) for p in prefixes):
            admitted = negate
    return admitted
