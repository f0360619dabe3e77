"""envd's port is one number, defined once in ``aenv.envd`` (which imports nothing, so the
host side and envd inside a guest both read it from there)."""

from __future__ import annotations

import ast
from importlib import resources
from pathlib import Path

import aenv
from aenv.envd import ENVD_PORT

AENV = Path(aenv.__file__).parent
DEFINITION = AENV / "envd" / "__init__.py"


def test_no_python_module_but_envd_names_the_port_as_a_number() -> None:
    found = []
    for path in sorted(AENV.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value == ENVD_PORT \
                    and type(node.value) is int:
                found.append(f"{path.relative_to(AENV)}:{node.lineno}")
    assert found == [f"{DEFINITION.relative_to(AENV)}:{_definition_line()}"]


def test_the_guest_supervisor_starts_envd_on_the_port() -> None:
    script = resources.files("aenv.guest").joinpath("files", "envd-supervise.sh").read_text()
    assert f" --port {ENVD_PORT} " in script


def test_the_envd_package_imports_nothing() -> None:
    tree = ast.parse(DEFINITION.read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def _definition_line() -> int:
    for node in ast.parse(DEFINITION.read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets
                                             if isinstance(t, ast.Name)] == ["ENVD_PORT"]:
            return node.lineno
    raise AssertionError("aenv/envd/__init__.py defines no ENVD_PORT")
