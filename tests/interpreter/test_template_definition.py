"""The shipped ``code-interpreter-v1`` definition as the CLI turns it into a build (no VM)."""

from __future__ import annotations

from aenv.cli import interpreter_template
from aenv.cli.template import build_spec
from aenv.interpreter import template


def test_recipe_copies_the_staged_site_and_starts_the_server_as_user() -> None:
    r = interpreter_template.recipe()
    spec = build_spec(r, {i: "h" for i, s in enumerate(r.steps) if s["type"] == "COPY"},
                      templates={"base"})
    assert spec["fromTemplate"] == "base"
    kinds = [s["type"] for s in spec["steps"]]
    assert kinds.count("COPY") == 2 and kinds.index("COPY") < kinds.index("USER")
    copies = [s for s in spec["steps"] if s["type"] == "COPY"]
    assert [c["args"][:2] for c in copies] == [["site", template.SITE],
                                               ["server/aenv", template.SITE + "/aenv"]]
    assert all(c["filesHash"] == "h" for c in copies)
    assert "--preload" in spec["startCmd"]
    assert [k for k in kinds if k in ("USER", "WORKDIR")] == ["USER", "WORKDIR"]
    assert "aenv.interpreter" in spec["startCmd"] and "--port 49999" in spec["startCmd"]
    assert "49999/health" in spec["readyCmd"]


def test_pip_targets_the_guest_python_with_wheels_only(tmp_path) -> None:
    cmd = interpreter_template.pip_command(tmp_path / "site")
    assert cmd[cmd.index("--python-version") + 1] == template.GUEST_PYTHON
    assert "--only-binary=:all:" in cmd and cmd[cmd.index("--target") + 1] == str(
        tmp_path / "site")
    assert {"ipykernel>=6.29", "jupyter_client>=8.6", "numpy", "pandas",
            "matplotlib"} <= set(cmd)


def test_key_follows_the_definition(monkeypatch) -> None:
    before = interpreter_template.key()
    assert interpreter_template.key() == before
    monkeypatch.setattr(template, "PACKAGES", (*template.PACKAGES, "scipy"))
    assert interpreter_template.key() != before
