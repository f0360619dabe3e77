"""``aenv template``: builds over E2B's template API against a live aenv server.

The server's sandboxes are host processes here (tests/control/process_machines.py), so a
build's steps run on this host as root: the steps below only echo, or write under a
temporary directory.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from .conftest import Aenv


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def templates(aenv: Aenv) -> dict[str, dict]:
    result = aenv("template", "ls", "--json")
    assert result.exit_code == 0, result.output
    return {name: t for t in json.loads(result.stdout) for name in t["names"]}


def test_build_from_flags_shows_logs_and_lands_in_ls(aenv: Aenv) -> None:
    name = unique("flags")
    result = aenv("template", "build", name, "--env", "GREETING=hello",
                  "--run", 'echo "greeting is $GREETING"', "--run", "echo second step")
    assert result.exit_code == 0, result.output
    assert "greeting is hello" in result.stderr and "second step" in result.stderr
    template_id = result.stdout.strip()
    listed = templates(aenv)
    assert listed[name]["templateID"] == template_id
    assert listed[name]["buildStatus"] == "ready"


def test_build_failure_exits_non_zero_with_the_reason(aenv: Aenv) -> None:
    result = aenv("template", "build", unique("fails"), "--run", "echo about to fail",
                  "--run", "exit 4")
    assert result.exit_code == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: build of") and "at step 2" in last
    assert "exit status 4" in last
    assert "about to fail" in result.stderr


def test_build_from_a_dockerfile(aenv: Aenv, tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text('FROM base\nARG MODE=fast\nENV WHO="the dockerfile"\n'
                          'RUN echo "built by $WHO in $MODE mode"\n')
    result = aenv("template", "build", unique("docker"), "-f", str(dockerfile))
    assert result.exit_code == 0, result.output
    assert "built by the dockerfile in fast mode" in result.stderr


def test_build_uploads_copy_sources_once(aenv: Aenv, tmp_path: Path) -> None:
    context = tmp_path / "ctx"
    (context / "app").mkdir(parents=True)
    (context / "app/main.py").write_text("print('hi')\n")
    dest = tmp_path / "copied"
    args = ("--copy", f"app:{dest}/", "-C", str(context))
    first = aenv("template", "build", unique("copy"), *args)
    assert first.exit_code == 0, first.output
    assert "uploaded 'app'" in first.stderr
    assert (dest / "main.py").read_text() == "print('hi')\n"  # the build "VM" is this host
    again = aenv("template", "build", unique("copy"), *args)
    assert again.exit_code == 0, again.output
    assert "'app' is already on the server" in again.stderr


def test_copy_of_missing_files_fails_before_contacting_the_server(aenv: Aenv,
                                                                  tmp_path: Path) -> None:
    result = aenv("template", "build", unique("nofiles"), "--copy", "absent:/x",
                  "-C", str(tmp_path))
    assert result.exit_code == 2
    assert "matches no files" in result.stderr


def test_rm_deletes_the_template(aenv: Aenv) -> None:
    name = unique("removable")
    assert aenv("template", "build", name, "--run", "true").exit_code == 0
    assert name in templates(aenv)
    assert aenv("template", "rm", name).exit_code == 0
    assert name not in templates(aenv)
    again = aenv("template", "rm", name)
    assert again.exit_code == 1
    assert again.stderr.strip() == f"error: template '{name}' not found (404)"


def test_a_built_template_starts_sandboxes(aenv: Aenv) -> None:
    name = unique("usable")
    assert aenv("template", "build", name, "--env", "FROM_TEMPLATE=yes").exit_code == 0
    created = aenv("sandbox", "create", name)
    assert created.exit_code == 0, created.output
    sid = created.stdout.strip()
    try:
        result = aenv("sandbox", "exec", sid, "--", "echo $FROM_TEMPLATE")
        assert result.stdout == "yes\n"
    finally:
        aenv("sandbox", "kill", sid)
