"""The shipped ``code-interpreter-v1`` definition as the CLI turns it into a build (no VM)."""

from __future__ import annotations

import json
from pathlib import Path

from aenv.cli import interpreter_template
from aenv.cli.template import build_spec
from aenv.interpreter import template
from aenv.interpreter.kernels import KERNEL_SPECS


def test_recipe_copies_the_staged_site_and_starts_the_server_as_user() -> None:
    r = interpreter_template.recipe()
    spec = build_spec(r, {i: "h" for i, s in enumerate(r.steps) if s["type"] == "COPY"},
                      templates={"base"})
    assert spec["fromTemplate"] == "base"
    kinds = [s["type"] for s in spec["steps"]]
    assert kinds.count("COPY") == 4 and kinds.index("COPY") < kinds.index("USER")
    copies = [s for s in spec["steps"] if s["type"] == "COPY"]
    assert [c["args"][:2] for c in copies] == [["site", template.SITE],
                                               ["deno", template.DENO_DIR],
                                               ["jupyter", template.JUPYTER_DIR],
                                               ["server/aenv", template.SITE + "/aenv"]]
    # the three large, rarely changing ones lead, so the server lays them on the host
    assert kinds[:3] == ["COPY"] * 3
    assert all(c["filesHash"] == "h" for c in copies)
    assert "--preload" in spec["startCmd"] and "--warm-up" in spec["startCmd"]
    assert f"--jupyter-path {template.JUPYTER_DIR}" in spec["startCmd"]
    assert [k for k in kinds if k in ("USER", "WORKDIR")] == ["USER", "WORKDIR"]
    assert "aenv.interpreter" in spec["startCmd"] and "--port 49999" in spec["startCmd"]
    assert "49999/health" in spec["readyCmd"]


def test_pip_targets_the_guest_python_with_wheels_only(tmp_path) -> None:
    cmd = interpreter_template.pip_command(tmp_path / "site")
    assert cmd[cmd.index("--python-version") + 1] == template.GUEST_PYTHON
    assert "--only-binary=:all:" in cmd and cmd[cmd.index("--target") + 1] == str(
        tmp_path / "site")
    assert {"ipykernel>=6.29", "jupyter_client>=8.6", "numpy", "pandas",
            "matplotlib", "bash_kernel"} <= set(cmd)


def test_key_follows_the_definition(monkeypatch) -> None:
    before = interpreter_template.key()
    assert interpreter_template.key() == before
    monkeypatch.setattr(template, "PACKAGES", (*template.PACKAGES, "scipy"))
    assert interpreter_template.key() != before


def test_key_follows_denos_version(monkeypatch) -> None:
    before = interpreter_template.key()
    monkeypatch.setattr(template, "DENO_VERSION", "0.0.1")
    assert interpreter_template.key() != before
    cmd = interpreter_template.npm_pack_command(Path("/x"))
    assert cmd[:2] == ["npm", "pack"] and cmd[-1] == f"{template.DENO_PACKAGE}@0.0.1"


def test_kernel_specs_are_written_afresh(tmp_path) -> None:
    jupyter = tmp_path / "jupyter"
    (jupyter / "kernels/gone").mkdir(parents=True)
    interpreter_template._write_kernel_specs(jupyter)
    names = sorted(p.name for p in (jupyter / "kernels").iterdir())
    assert names == sorted(template.KERNELS) and "gone" not in names
    deno = json.loads((jupyter / "kernels/deno/kernel.json").read_text())
    assert deno["argv"][:3] == [f"{template.DENO_DIR}/deno", "jupyter", "--kernel"]
    assert "{connection_file}" in deno["argv"] and deno["env"]["NO_COLOR"] == "1"
    bash = json.loads((jupyter / "kernels/bash/kernel.json").read_text())
    assert bash["argv"][:3] == ["python3", "-m", "bash_kernel"]
    # the server's languages reach these specs
    assert {KERNEL_SPECS[lang] for lang in ("javascript", "typescript", "bash")} \
        == set(template.KERNELS)
