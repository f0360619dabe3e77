"""Template builds without a VM: COPY's semantics (the script a COPY step runs, executed
here by bash on a temporary tree), the words a failed step reaches the SDK in, and the
states of reservations that are refused, superseded or never started.

The COPY script runs as root on this host against paths under ``tmp_path`` only; owners are
the host's ``daemon`` (a user with a same-name group) and ``nobody:nogroup``.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import subprocess
import time
from pathlib import Path

import pytest

from aenv.client.envd import CommandResult, EnvdError
from aenv.orchestrator.builds import (
    SUPERSEDED,
    WAITED_TOO_LONG,
    BuildContext,
    Builder,
    StepFailed,
    copy_owner,
    copy_script,
    copy_source_base,
    extract_command,
)
from aenv.orchestrator.errors import Conflict, InvalidRequest, TemplateNotFound
from aenv.store import TemplateRecord, TemplateStore
from aenv.store.db import Database

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")


# -- which part of the archive a source copies ----------------------------------------------


@pytest.mark.parametrize(("src", "base"), [
    ("folder/*", "folder"),
    ("folder/*.txt", "folder"),
    ("a.txt", "a.txt"),
    ("dir", "dir"),
    ("dir/", "dir"),
    ("*.txt", "."),
    (".", "."),
    ("src/**/*.py", "src"),
    ("a/b/c?.txt", "a/b"),
    ("a/[xy]/z", "a"),
    ("./a/b", "a/b"),
    ("foo/../bar", "bar"),
    ("with space/*", "with space"),
    (r"lit\*eral/x*", "lit*eral"),
])
def test_a_source_copies_its_part_before_the_first_glob(src: str, base: str) -> None:
    assert copy_source_base(src) == base


@pytest.mark.parametrize("src", ["/etc/passwd", "../x", "a/../../x", ".."])
def test_a_source_outside_the_context_is_refused(src: str) -> None:
    with pytest.raises(ValueError):
        copy_source_base(src)


def test_an_owner_without_a_group_is_user_colon_user() -> None:
    assert copy_owner("", "root") == "root:root"
    assert copy_owner("user", "root") == "user:user"
    assert copy_owner("user:users", "root") == "user:users"


# -- the COPY script ------------------------------------------------------------------------


class Copy:
    """An unpacked archive under ``tmp/unpack`` (as the SDK packs a context: paths relative
    to it), and the COPY script run on it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.unpack = tmp / "unpack"
        self.unpack.mkdir()
        self.dest = tmp / "dest"

    def file(self, rel: str, text: str = "", mode: int = 0o644) -> None:
        path = self.unpack / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text or f"content of {rel}\n")
        path.chmod(mode)

    def link(self, rel: str, target: str) -> None:
        path = self.unpack / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, path)

    def run(self, src: str, dest: str, *, owner: str = "", mode: str = "",
            workdir: str | None = None, user: str = "root") -> subprocess.CompletedProcess:
        entry = os.path.normpath(os.path.join(self.unpack, copy_source_base(src)))
        script = copy_script(entry=entry, src=src, dest=dest, owner=copy_owner(owner, user),
                             mode=mode, workdir=workdir, user=user)
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                              timeout=30, check=False)

    def ok(self, *args, **kwargs) -> None:
        r = self.run(*args, **kwargs)
        assert r.returncode == 0, r.stderr


def listing(root: Path) -> dict[str, str]:
    """Relative path → 'file <content>', 'link <target>' or 'dir'."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = f"link {os.readlink(path)}"
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = f"file {path.read_text().strip()}"
    return out


def owner_of(path: Path) -> str:
    st = path.lstat()
    return f"{pwd.getpwuid(st.st_uid).pw_name}:{grp.getgrgid(st.st_gid).gr_name}"


@pytest.fixture
def cp(tmp_path) -> Copy:
    return Copy(tmp_path)


@needs_root
def test_a_glob_with_several_matches_fills_the_destination_directory(cp: Copy) -> None:
    for name in ("test.txt", "a.txt", "b.txt"):
        cp.file(f"folder/{name}")
    cp.link("folder/symlink.txt", "test.txt")
    cp.link("folder/dangling.txt", "12345test.txt")
    cp.ok("folder/*", str(cp.dest))  # no trailing slash: still a directory
    assert listing(cp.dest) == {
        "a.txt": "file content of folder/a.txt", "b.txt": "file content of folder/b.txt",
        "dangling.txt": "link 12345test.txt", "symlink.txt": "link test.txt",
        "test.txt": "file content of folder/test.txt"}


@needs_root
def test_matches_in_subdirectories_keep_their_place_under_the_base(cp: Copy) -> None:
    cp.file("src/a.py")
    cp.file("src/pkg/b.py")
    cp.ok("src/**/*.py", f"{cp.dest}/")
    assert listing(cp.dest) == {"a.py": "file content of src/a.py", "pkg": "dir",
                                "pkg/b.py": "file content of src/pkg/b.py"}


@needs_root
def test_a_top_level_glob_copies_the_archive_root(cp: Copy) -> None:
    cp.file("x.txt")
    cp.file("y.txt")
    cp.ok("*.txt", str(cp.dest))
    assert sorted(listing(cp.dest)) == ["x.txt", "y.txt"]


@needs_root
def test_a_file_is_renamed_to_the_destination_or_put_into_one_ending_in_a_slash(
        cp: Copy) -> None:
    cp.file("a.txt")
    cp.ok("a.txt", f"{cp.dest}/deep/renamed.txt")
    cp.file("a.txt", "again")
    cp.ok("a.txt", f"{cp.dest}/into/")
    assert listing(cp.dest) == {"deep": "dir", "deep/renamed.txt": "file content of a.txt",
                                "into": "dir", "into/a.txt": "file again"}


@needs_root
def test_a_directory_source_merges_its_contents_into_the_destination(cp: Copy) -> None:
    cp.file("app/new.txt", "new")
    cp.file("app/sub/same.txt", "replaced")
    (cp.dest / "sub").mkdir(parents=True)
    (cp.dest / "keep.txt").write_text("kept")
    (cp.dest / "sub/same.txt").write_text("old")
    cp.dest.chmod(0o750)
    cp.ok("app", str(cp.dest))
    assert listing(cp.dest) == {"keep.txt": "file kept", "new.txt": "file new", "sub": "dir",
                                "sub/same.txt": "file replaced"}
    assert stat.S_IMODE(cp.dest.stat().st_mode) == 0o750  # an existing directory is kept


@needs_root
def test_a_symlink_source_stays_a_symlink_even_when_dangling(cp: Copy) -> None:
    cp.link("gone.txt", "/nowhere/at/all")
    cp.ok("gone.txt", f"{cp.dest}/kept.txt")
    assert listing(cp.dest) == {"kept.txt": "link /nowhere/at/all"}


@needs_root
def test_mode_applies_to_every_file_and_directory_but_not_symlinks(cp: Copy) -> None:
    cp.file("bin/tool.sh")
    cp.file("bin/lib/helper.sh")
    cp.link("bin/link", "tool.sh")
    cp.ok("bin", str(cp.dest), mode="0755")
    for rel in ("tool.sh", "lib/helper.sh", "lib"):
        assert stat.S_IMODE((cp.dest / rel).stat().st_mode) == 0o755, rel
    assert os.readlink(cp.dest / "link") == "tool.sh"
    cp.file("one.txt")
    cp.ok("one.txt", f"{cp.dest}/one.txt", mode="0600")
    assert stat.S_IMODE((cp.dest / "one.txt").stat().st_mode) == 0o600


@needs_root
def test_without_a_mode_files_keep_their_own(cp: Copy) -> None:
    cp.file("run.sh", mode=0o750)
    cp.ok("run.sh", f"{cp.dest}/")
    assert stat.S_IMODE((cp.dest / "run.sh").stat().st_mode) == 0o750


@needs_root
def test_the_owner_owns_every_entry_and_the_directories_the_copy_made(cp: Copy) -> None:
    cp.file("folder/a.txt")
    cp.file("folder/sub/b.txt")
    cp.link("folder/link", "/etc/passwd")
    existing = cp.tmp / "existing"
    existing.mkdir()
    cp.ok("folder", f"{existing}/made/here", owner="daemon")
    for rel in ("made", "made/here", "made/here/a.txt", "made/here/sub",
                "made/here/sub/b.txt", "made/here/link"):
        assert owner_of(existing / rel) == "daemon:daemon", rel
    assert owner_of(existing) == "root:root"  # it was there before
    assert owner_of(Path("/etc/passwd")) == "root:root"  # a symlink is never followed
    cp.file("g.txt")
    cp.ok("g.txt", f"{cp.dest}/g.txt", owner="nobody:nogroup")
    assert owner_of(cp.dest / "g.txt") == "nobody:nogroup"


@needs_root
def test_by_default_the_build_user_owns_the_files(cp: Copy) -> None:
    cp.file("a.txt")
    cp.ok("a.txt", f"{cp.dest}/a.txt", user="daemon", workdir="/")
    assert owner_of(cp.dest / "a.txt") == "daemon:daemon"


@needs_root
def test_a_relative_destination_is_under_the_workdir(cp: Copy) -> None:
    cp.file("a.txt")
    cp.ok("a.txt", "rel/a.txt", workdir=str(cp.tmp / "wd"))
    assert (cp.tmp / "wd/rel/a.txt").read_text() == "content of a.txt\n"


@needs_root
def test_an_unknown_owner_fails_with_chowns_words(cp: Copy) -> None:
    cp.file("a.txt")
    r = cp.run("a.txt", f"{cp.dest}/a.txt", owner="nosuchowner")
    assert r.returncode == 1
    assert "invalid user" in r.stderr and "nosuchowner" in r.stderr


@needs_root
def test_a_source_missing_from_the_archive_fails(cp: Copy) -> None:
    cp.file("other.txt")
    r = cp.run("missing/*", str(cp.dest))
    assert r.returncode == 1
    assert "source path does not exist: missing/*" in r.stderr


@needs_root
def test_names_reach_the_shell_as_data(cp: Copy) -> None:
    evil = "$(touch pwned) `touch pwned2` 'q\" ;x"
    cp.file(f"{evil}/f.txt")
    cp.ok(f"{evil}/*", f"{cp.dest}/{evil}/")
    assert (cp.dest / evil / "f.txt").exists()
    assert not list(cp.tmp.rglob("pwned*")) and not Path("pwned").exists()


def test_the_archive_is_unpacked_and_removed(tmp_path) -> None:
    import tarfile
    (tmp_path / "a.txt").write_text("a")
    archive = tmp_path / "in.tar"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "a.txt", arcname="folder/a.txt")
    unpack = tmp_path / "w/unpack"
    subprocess.run(["bash", "-c", extract_command(str(archive), str(unpack))], check=True)
    assert (unpack / "folder/a.txt").read_text() == "a" and not archive.exists()
    r = subprocess.run(["bash", "-c", extract_command(str(archive), str(unpack))],
                       capture_output=True, check=False)
    assert r.returncode != 0 and not unpack.exists()


# -- how a failed step reads ----------------------------------------------------------------


class FakeEnvd:
    """``EnvdClient.run`` as far as ``Builder._run_cmd`` uses it."""

    def __init__(self, chunks: list[tuple[str, str]] = (), exit_code: int = 0,
                 error: Exception | None = None) -> None:
        self.chunks, self.exit_code, self.error = list(chunks), exit_code, error
        self.calls: list[dict] = []

    async def run(self, cmd, *, user=None, cwd=None, envs=None, timeout=600, on_output=None):
        self.calls.append({"cmd": cmd, "user": user, "cwd": cwd})
        if self.error is not None:
            raise self.error
        for stream, text in self.chunks:
            on_output(stream, text)
        status = f"exit status {self.exit_code}"
        return CommandResult(self.exit_code, "", "", status if self.exit_code else None)


@pytest.fixture
def builder(tmp_path) -> Builder:
    return Builder(TemplateStore(Database(tmp_path / "aenv.db")), None, tmp_path / "files")


@pytest.fixture
def build_id(builder) -> str:
    return builder.request("steps")[1].id


def logged(builder: Builder, build_id: str) -> list[tuple[str | None, str]]:
    return [(e["step"], e["message"]) for e in builder.templates.logs(build_id)]


async def test_a_failing_run_says_e2bs_words_then_the_steps_last_output(builder, build_id) -> None:
    envd = FakeEnvd([("stdout", "first li"), ("stdout", "ne\n\nsecond\n"),
                     ("stderr", "boom\n")], exit_code=3)
    with pytest.raises(StepFailed) as e:
        await builder._step(envd, build_id, "2", {"type": "RUN", "args": ["make it"]},
                            BuildContext())
    assert str(e.value) == ("failed to run command 'make it': exit status 3\n"
                            "step 2 output:\nfirst line\nsecond\nboom")
    assert e.value.step == "2"
    # A line split across chunks is one log line; blank lines are dropped.
    assert logged(builder, build_id)[1:] == [("2", "first line"), ("2", "second"), ("2", "boom")]


async def test_only_the_end_of_a_long_output_is_in_the_message(builder, build_id) -> None:
    envd = FakeEnvd([("stdout", "".join(f"line {i}\n" for i in range(100)))], exit_code=1)
    with pytest.raises(StepFailed) as e:
        await builder._run_cmd(envd, build_id, "1", "noisy", user="root", ctx=BuildContext())
    head, *lines = str(e.value).split("\n")
    assert head == "failed to run command 'noisy': exit status 1"
    assert lines[0] == "step 1 last 20 of 100 lines:"
    assert lines[1:] == [f"line {i}" for i in range(80, 100)]


async def test_a_command_without_output_fails_with_one_line(builder, build_id) -> None:
    with pytest.raises(StepFailed, match=r"^failed to run command 'exit 7': exit status 7$"):
        await builder._run_cmd(FakeEnvd(exit_code=7), build_id, "1", "exit 7", user="root",
                               ctx=BuildContext())


async def test_an_unknown_run_user_reads_as_e2bs_message(builder, build_id) -> None:
    envd = FakeEnvd(error=EnvdError("invalid username: 'root123'", "unauthenticated"))
    with pytest.raises(StepFailed) as e:
        await builder._step(envd, build_id, "1", {"type": "RUN", "args": ["whoami", "root123"]},
                            BuildContext())
    assert str(e.value) == ("failed to run command 'whoami': command failed: "
                            "unauthenticated: invalid username: 'root123'")
    assert envd.calls[0]["user"] == "root123"


# -- reservations never left waiting --------------------------------------------------------


def ready_base(builder: Builder) -> None:
    now = time.time()
    builder.templates.insert(TemplateRecord(
        id="base", kind="template", build_id="builtin", status="ready", cpu_count=1,
        memory_mb=512, disk_size_mb=2048, created_at=now, updated_at=now, names=["base"]))


def build_of(builder: Builder, build_id: str):
    return builder.templates.get_build(build_id)


def test_a_new_template_holds_its_name_from_the_request(builder) -> None:
    tpl, _, _ = builder.request("fresh")
    again, _, _ = builder.request("fresh:v2")
    assert again.id == tpl.id
    assert builder.templates.get("fresh").id == tpl.id
    assert builder.templates.get(tpl.id).status == "waiting"


@pytest.mark.parametrize(("spec", "step", "error", "match"), [
    ({"fromImage": "ubuntu:22.04"}, "base", InvalidRequest, "fromImage"),
    ({"fromTemplate": "no-such-parent"}, "base", TemplateNotFound, "no-such-parent"),
    ({"steps": [{"type": "RUN", "args": ["x"]}, {"type": "BOGUS"}]}, "2", InvalidRequest,
     "unknown type 'BOGUS'"),
    ({"steps": [{"type": "COPY", "args": ["a", "b"], "filesHash": "ab" * 32}]}, "1",
     InvalidRequest, "were not uploaded"),
    ({"steps": [{"type": "COPY", "args": ["a", "b"], "filesHash": "../../etc"}]}, "1",
     InvalidRequest, "invalid files hash"),
])
def test_a_refused_start_fails_its_build_and_template(builder, spec, step, error,
                                                      match) -> None:
    ready_base(builder)
    tpl, build, _ = builder.request("refused")
    with pytest.raises(error, match=match):
        builder.start(tpl.id, build.id, spec)
    b = build_of(builder, build.id)
    assert (b.status, b.reason_step) == ("error", step) and match in b.reason
    assert builder.templates.get(tpl.id).status == "error"
    assert logged(builder, build.id)[-1] == (step, f"Build failed: {b.reason}")


def test_a_refused_rebuild_leaves_a_ready_template_ready(builder) -> None:
    ready_base(builder)
    tpl, build, _ = builder.request("rebuilt")
    builder.templates.update(tpl.id, status="ready", image="img")
    with pytest.raises(InvalidRequest):
        builder.start(tpl.id, build.id, {"fromImage": "x"})
    assert build_of(builder, build.id).status == "error"
    assert builder.templates.get(tpl.id).status == "ready"


def test_starting_a_started_build_again_changes_nothing(builder) -> None:
    tpl, build, _ = builder.request("twice")
    builder.templates.update_build(build.id, status="building")
    with pytest.raises(Conflict):
        builder.start(tpl.id, build.id, {"fromImage": "x"})
    assert build_of(builder, build.id).status == "building"


def test_a_newer_reservation_for_the_same_tag_supersedes_an_unstarted_one(builder) -> None:
    tpl, first, _ = builder.request("sup")
    _, other_tag, _ = builder.request("sup:v2")
    _, second, _ = builder.request("sup")
    old = build_of(builder, first.id)
    assert (old.status, old.reason) == ("error", SUPERSEDED)
    assert build_of(builder, other_tag.id).status == "waiting"  # another tag: kept
    assert build_of(builder, second.id).status == "waiting"
    assert builder.templates.get(tpl.id).status == "waiting"


def test_a_reservation_never_started_fails_after_the_deadline(builder) -> None:
    tpl, build, _ = builder.request("late")
    builder.expire_waiting(now=time.time() + builder.waiting_deadline - 5)
    assert build_of(builder, build.id).status == "waiting"
    builder.expire_waiting(now=time.time() + builder.waiting_deadline + 5)
    b = build_of(builder, build.id)
    assert (b.status, b.reason) == ("error", WAITED_TOO_LONG)
    assert builder.templates.get(tpl.id).status == "error"


async def test_recover_fails_interrupted_builds_and_sweeps_old_reservations(tmp_path) -> None:
    builder = Builder(TemplateStore(Database(tmp_path / "aenv.db")), None, tmp_path / "f",
                      waiting_deadline=0)
    tpl, running, _ = builder.request("interrupted")
    builder.templates.update_build(running.id, status="building")
    _, stale, _ = builder.request("stale")
    time.sleep(0.01)
    builder.recover()
    try:
        assert build_of(builder, running.id).status == "error"
        assert build_of(builder, stale.id).reason == WAITED_TOO_LONG
        assert builder.templates.get(tpl.id).status == "error"
        assert builder._sweeper is not None and not builder._sweeper.done()
    finally:
        await builder.close()
    assert builder._sweeper is None


# -- leading COPY steps laid on the host ----------------------------------------------------


class LayingImages:
    """An ``ImageSource`` that records what ``base_with`` was asked to lay."""

    def __init__(self, error: Exception | None = None) -> None:
        self.asked: list = []
        self.error = error

    def prepare(self, request, say):  # pragma: no cover - not a fromImage build
        raise AssertionError("no pull")

    def base_with(self, layers, say) -> str:
        self.asked.append(list(layers))
        if self.error is not None:
            raise self.error
        return "image:" + "a" * 64


def uploaded(builder: Builder, tmp_path: Path, src: str, dest: str) -> dict:
    from aenv.client.build_files import files_hash, tar_archive
    ctx = tmp_path / "ctx"
    (ctx / src / "pkg").mkdir(parents=True, exist_ok=True)
    (ctx / src / "pkg/m.py").write_text(f"# {src}\n")
    h = files_hash(src, dest, ctx, [])
    data, _ = tar_archive(src, ctx, [])
    builder.files_dir.mkdir(parents=True, exist_ok=True)
    builder.file_path(h).write_bytes(data.read())
    return {"type": "COPY", "args": [src, dest], "filesHash": h}


async def test_leading_copies_from_base_become_the_parents_image(tmp_path) -> None:
    from aenv.storage.images import NotLayerable
    source = LayingImages()
    builder = Builder(TemplateStore(Database(tmp_path / "aenv.db")), None, tmp_path / "files",
                      images=source)
    ready_base(builder)
    base = builder.templates.get("base")
    tpl, build, _ = builder.request("big")
    steps = [uploaded(builder, tmp_path, "site", "/opt/site"),
             uploaded(builder, tmp_path, "more", "/opt/more"),
             {"type": "RUN", "args": ["true"]},
             uploaded(builder, tmp_path, "late", "/opt/late")]
    parent, laid = await builder._lay_copies(tpl.id, build.id, base, {"steps": steps})
    assert laid == 2 and parent.image == "image:" + "a" * 64
    assert (parent.user, parent.workdir, parent.env_vars) == (base.user, base.workdir, {})
    assert [(x.entry, x.dest) for x in source.asked[0]] == [("site", "/opt/site"),
                                                           ("more", "/opt/more")]
    assert source.asked[0][0].key == steps[0]["filesHash"]
    # not from base, an owner, or a relative destination: the guest copies
    assert await builder._lay_copies(tpl.id, build.id, parent, {"steps": steps}) == (parent, 0)
    owned = [{**steps[0], "args": ["site", "/opt/site", "user"]}]
    assert await builder._lay_copies(tpl.id, build.id, base, {"steps": owned}) == (base, 0)
    # what the host refuses runs in the guest too
    source.error = NotLayerable("exists")
    assert await builder._lay_copies(tpl.id, build.id, base, {"steps": steps}) == (base, 0)
    assert ("base", "the COPY steps run in the guest: exists") in logged(builder, build.id)
