"""Test helpers for the Firecracker driver: the API schema subset and the fake binary.

``check_request`` validates one request (method, path, body) against the subset of
Firecracker v1.16.1's published API in ``firecracker_api_v1.16.1_subset.yaml``; the fake
(``fake_firecracker.py``) is installed as ``firecracker`` on a temporary PATH and records
every request it serves. Together they prove the driver speaks the published API contract
in the right order; they do not prove that a guest boots (only a real Firecracker on
hardware KVM can, see ``test_firecracker_vm.py``).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

HERE = Path(__file__).parent
SCHEMA_FILE = HERE / "firecracker_api_v1.16.1_subset.yaml"
FAKE = HERE / "fake_firecracker.py"


@cache
def api() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_FILE.read_text())


def operation(method: str, path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The spec's operation for a concrete path, and the path parameters it binds."""
    for template, ops in api()["paths"].items():
        pattern = "^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", template) + "$"
        m = re.match(pattern, path)
        if m and method.lower() in ops:
            return ops[method.lower()], m.groupdict()
    raise AssertionError(f"{method} {path} is not an operation of the v1.16.1 API subset")


def check_request(method: str, path: str, body: Any) -> None:
    """Fail unless ``body`` is what the spec's operation for ``method path`` accepts."""
    op, params = operation(method, path)
    body_params = [p for p in op.get("parameters", []) if p["in"] == "body"]
    if not body_params:
        assert body is None, f"{method} {path} takes no body, got {body!r}"
        return
    if body is None:
        assert not body_params[0].get("required"), f"{method} {path} needs a body"
        return
    name = body_params[0]["schema"]["$ref"].rsplit("/", 1)[-1]
    definitions = api()["definitions"]
    jsonschema.Draft4Validator(dict(definitions[name], definitions=definitions)).validate(body)
    for key, value in params.items():  # Firecracker wants the id in the body to match
        assert body.get(key) == value, f"{path}: body {key}={body.get(key)!r} != {value!r}"


@dataclass
class FakeFirecracker:
    """The fake binary on PATH and what it recorded (one JSON line per request/event)."""

    bin_dir: Path
    record: Path

    @classmethod
    def install(cls, directory: Path) -> FakeFirecracker:
        bin_dir = directory / "bin"
        bin_dir.mkdir()
        exe = bin_dir / "firecracker"
        exe.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
        exe.chmod(0o755)
        return cls(bin_dir, directory / "fc-record.jsonl")

    def entries(self, pid: int | None = None) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        lines = [json.loads(ln) for ln in self.record.read_text().splitlines()]
        return [e for e in lines if pid is None or e.get("pid") == pid]

    def requests(self, pid: int | None = None) -> list[tuple[str, str, Any]]:
        return [(e["method"], e["path"], e["body"]) for e in self.entries(pid) if "method" in e]

    def starts(self) -> list[dict[str, Any]]:
        return [e for e in self.entries() if e.get("event") == "start"]
