"""COPY semantics and build errors as E2B's SDK users meet them (``Template.build`` against
a live server, real microVMs).

COPY follows E2B's template manager (``copy_script.sh`` in e2b-dev/infra): the client has
already matched the glob, the archive holds the matches, and the step copies the source's
part before its first glob segment (``folder`` for ``folder/*``): a directory's contents go
into the destination directory, a file is renamed to the destination unless it ends in
``/``, symlinks stay symlinks (dangling or not) unless ``resolve_symlinks`` sent their
targets, ``mode`` and ``user`` (``user`` or ``user:group``) apply to every copied entry.

One build carries every COPY claim; a sandbox from it checks them. The failing builds are
each small: a sandbox from the base snapshot, one step. The module has a server of its own
(its own name prefix and address ranges), so it runs beside the other server tests.
"""

from __future__ import annotations

import linecache
import os
import uuid
from pathlib import Path

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException

from tests.server.conftest import ServerProcess

# The first test waits for the server (its base snapshot) and the shared COPY build.
pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def sdk(module_sdk: ServerProcess) -> ServerProcess:
    """The session's server, and the E2B SDK pointed at it (for the module's build)."""
    return module_sdk


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def statuses(sdk) -> dict[str, str]:
    """``GET /templates``: build status by name."""
    with sdk.api() as c:
        r = c.get("/templates")
        r.raise_for_status()
        return {name: t["buildStatus"] for t in r.json() for name in t["names"]}


def context(root: Path) -> Path:
    ctx = root / "ctx"
    folder = ctx / "folder"
    folder.mkdir(parents=True)
    for name in ("test.txt", "a.txt", "b.txt"):
        (folder / name).write_text(f"content of {name}\n")
    os.symlink("test.txt", folder / "symlink.txt")
    os.symlink("12345test.txt", folder / "dangling.txt")  # points nowhere
    (ctx / "bin").mkdir()
    for name in ("tool.sh", "other.sh"):
        (ctx / "bin" / name).write_text("#!/bin/sh\necho tool\n")
        os.chmod(ctx / "bin" / name, 0o644)
    (ctx / "links").mkdir()
    (ctx / "links/real.txt").write_text("the real file\n")
    os.symlink("real.txt", ctx / "links/link.txt")
    return ctx


@pytest.fixture(scope="module")
def copied(sdk, tmp_path_factory):
    """One template with every COPY case, and a sandbox from it (commands run as root)."""
    ctx = context(tmp_path_factory.mktemp("copy"))
    name = unique("e2e-copy")
    template = (
        Template(file_context_path=str(ctx))
        .from_template("base")
        # A relative destination is under the build user's home (root: /root).
        .copy("folder/*", "folder")
        .copy("links/*", "/opt/resolved", resolve_symlinks=True)
        .copy("links/link.txt", "/opt/kept.txt")
        .copy("bin", "/opt/bin", mode=0o755)
        .copy("folder/a.txt", "/opt/single.txt", mode=0o600)
        .copy("folder/b.txt", "/opt/into/")
        .copy("folder", "/srv/owned/by-user", user="user")
        .copy("bin/tool.sh", "/srv/group/", user="user:users")
    )
    Template.build(template, name)
    sbx = Sandbox.create(name)

    def sh(cmd: str) -> str:
        r = sbx.commands.run(cmd, user="root")
        return r.stdout.strip()

    try:
        yield sh
    finally:
        sbx.kill()


def test_a_glob_with_several_matches_lands_each_file_in_the_directory(copied) -> None:
    assert copied("ls -A /root/folder").split() == sorted(
        ["a.txt", "b.txt", "dangling.txt", "symlink.txt", "test.txt"])
    for name in ("test.txt", "a.txt", "b.txt"):
        assert copied(f"cat /root/folder/{name}") == f"content of {name}"


def test_symlinks_among_the_matches_are_kept_as_symlinks_even_dangling(copied) -> None:
    assert copied("readlink /root/folder/symlink.txt") == "test.txt"
    assert copied("cat /root/folder/symlink.txt") == "content of test.txt"
    assert copied("readlink /root/folder/dangling.txt") == "12345test.txt"
    assert copied("[ -e /root/folder/dangling.txt ] && echo exists || echo dangling") == \
        "dangling"
    assert copied("readlink /opt/kept.txt") == "real.txt"


def test_resolve_symlinks_copies_the_target(copied) -> None:
    assert copied("stat -c %F /opt/resolved/link.txt") == "regular file"
    assert copied("cat /opt/resolved/link.txt") == "the real file"
    assert copied("cat /opt/resolved/real.txt") == "the real file"


def test_mode_applies_to_every_copied_file(copied) -> None:
    assert copied("stat -c '%n %a' /opt/bin/tool.sh /opt/bin/other.sh").splitlines() == \
        ["/opt/bin/tool.sh 755", "/opt/bin/other.sh 755"]
    assert copied("stat -c %a /opt/single.txt") == "600"
    # Without a mode, the file keeps its own.
    assert copied("stat -c %a /opt/into/b.txt") == "644"


def test_a_destination_ending_in_a_slash_is_a_directory(copied) -> None:
    assert copied("cat /opt/into/b.txt") == "content of b.txt"
    assert copied("cat /opt/single.txt") == "content of a.txt"


def test_user_and_group_own_what_was_copied(copied) -> None:
    owners = copied("cd /srv/owned/by-user && stat -c '%n %U:%G' . test.txt a.txt symlink.txt")
    assert owners.splitlines() == [". user:user", "test.txt user:user", "a.txt user:user",
                                   "symlink.txt user:user"]
    assert copied("stat -c %U:%G /srv/group/tool.sh") == "user:users"
    # By default the build user owns the files (root here).
    assert copied("stat -c %U:%G /opt/single.txt") == "root:root"


# -- build errors ---------------------------------------------------------------------------


def raised_at(exc: BaseException, needle: str) -> bool:
    """Whether the exception's traceback has a line of this file containing ``needle``."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == __file__ and \
                needle in linecache.getline(__file__, tb.tb_lineno):
            return True
        tb = tb.tb_next
    return False


def test_a_failing_run_names_its_command_step_and_output(sdk) -> None:
    name = unique("e2e-runfail")
    template = (Template().from_template("base").run_cmd("echo fine")
                .run_cmd("echo out-line; echo err-line >&2; exit 3"))
    with pytest.raises(BuildException) as e:
        Template.build(template, name)
    message = str(e.value)
    assert message.startswith(
        "failed to run command 'echo out-line; echo err-line >&2; exit 3': exit status 3")
    assert "step 2" in message and "out-line" in message and "err-line" in message
    # reason.step points the SDK's traceback at the failing call.
    assert raised_at(e.value, 'exit 3")')
    assert statuses(sdk)[name] == "error"


def test_an_unknown_run_user_fails_with_e2bs_message(sdk) -> None:
    name = unique("e2e-nouser")
    with pytest.raises(BuildException) as e:
        Template.build(Template().from_template("base").run_cmd("whoami", user="root123"), name)
    assert "failed to run command 'whoami': command failed: unauthenticated: " \
        "invalid username: 'root123'" in str(e.value)
    assert statuses(sdk)[name] == "error"


def test_an_unknown_copy_owner_fails_clearly(sdk, tmp_path) -> None:
    (tmp_path / "a.txt").write_text("a\n")
    name = unique("e2e-noowner")
    template = Template(file_context_path=str(tmp_path)).from_template("base") \
        .copy("a.txt", "/opt/a.txt", user="nosuchowner")
    with pytest.raises(BuildException) as e:
        Template.build(template, name)
    message = str(e.value)
    assert message.startswith("failed to move files in sandbox: exit status 1")
    assert "invalid user" in message and "nosuchowner" in message
    assert statuses(sdk)[name] == "error"


def test_a_build_refused_at_start_is_an_error_not_waiting(sdk) -> None:
    # credentials aenv cannot use are refused before anything is pulled (nothing leaves
    # loopback: the registry named here is never contacted)
    name = unique("e2e-fromimage")
    template = Template().from_aws_registry(
        "123456789012.dkr.ecr.us-east-1.amazonaws.com/app:1", access_key_id="AKIA",
        secret_access_key="secret", region="us-east-1").run_cmd("true")
    with pytest.raises(BuildException, match="type 'aws' are not supported"):
        Template.build(template, name)
    assert statuses(sdk)[name] == "error"


def test_a_reservation_superseded_by_a_newer_one_fails(sdk) -> None:
    name = unique("e2e-supersede")
    with sdk.api() as c:
        first = c.post("/v3/templates", json={"name": name}).json()
        second = c.post("/v3/templates", json={"name": name}).json()
        assert first["templateID"] == second["templateID"]
        old = c.get(f"/templates/{first['templateID']}/builds/{first['buildID']}/status").json()
        new = c.get(f"/templates/{second['templateID']}/builds/{second['buildID']}/status").json()
    assert old["status"] == "error"
    assert old["reason"]["message"] == \
        "The build was canceled because it was superseded by a newer one."
    assert new["status"] == "waiting"
    assert statuses(sdk)[name] == "waiting"  # the newer reservation is still open
