"""Template builds through the real SDK (``Template.build``): steps, COPY, env, workdir;
then a sandbox from the built template sees what the build made."""

from __future__ import annotations

import uuid

import pytest
from e2b import Sandbox, Template

pytestmark = [pytest.mark.vm, pytest.mark.net]


def test_build_with_steps_and_copy_then_create_from_it(sdk, tmp_path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "app").mkdir(parents=True)
    (ctx / "app/main.py").write_text("print('from the build context')\n")
    (ctx / "notes.txt").write_text("copied file\n")
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    template = (
        Template(file_context_path=str(ctx))
        .from_template("base")
        .set_envs({"GREETING": "hello-from-template"})
        .copy("app", "/home/user/app/")
        .copy("notes.txt", "/opt/notes.txt")
        .run_cmd("echo built-by-run > /home/user/built.txt && chown user: /home/user/built.txt")
        .set_workdir("/home/user/app")
    )
    logs = []
    Template.build(template, name, on_build_logs=lambda e: logs.append(e.message))
    assert any("RUN" in m for m in logs)

    sbx = Sandbox.create(name)
    try:
        assert sbx.commands.run("echo $GREETING").stdout.strip() == "hello-from-template"
        assert sbx.commands.run("python3 /home/user/app/main.py").stdout.strip() == \
            "from the build context"
        assert sbx.files.read("/opt/notes.txt") == "copied file\n"
        assert sbx.files.read("/home/user/built.txt").strip() == "built-by-run"
        assert sbx.commands.run("pwd").stdout.strip() == "/home/user/app"
    finally:
        sbx.kill()
    assert Template.exists(name)


def test_a_failing_step_fails_the_build_with_its_reason(sdk) -> None:
    from e2b.exceptions import BuildException

    template = Template().from_template("base").run_cmd("exit 7")
    with pytest.raises(BuildException, match="exit status 7"):
        Template.build(template, f"e2e-fail-{uuid.uuid4().hex[:8]}")


def test_a_template_is_a_snapshot_with_its_start_command_running(sdk) -> None:
    name = f"e2e-start-{uuid.uuid4().hex[:8]}"
    template = (
        Template().from_template("base")
        .run_cmd("cat /proc/sys/kernel/random/boot_id > /home/user/build-boot-id")
        .set_start_cmd("nohup python3 -m http.server 8000 --directory /tmp >/dev/null 2>&1 &",
                       "curl -sf http://127.0.0.1:8000/ >/dev/null || "
                       "python3 -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:8000/\")'")
    )
    Template.build(template, name)
    sbx, other = Sandbox.create(name), Sandbox.create(name)
    try:
        # No boot happened: the server started during the build is still running, and
        # both sandboxes still have the build VM's boot id (every boot draws a new one).
        assert "http.server 8000" in sbx.commands.run("ps -eo args").stdout
        for s in (sbx, other):
            assert s.commands.run("cat /proc/sys/kernel/random/boot_id").stdout == \
                s.files.read("/home/user/build-boot-id")
    finally:
        sbx.kill()
        other.kill()
