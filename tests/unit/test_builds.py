"""Template builds without a VM: COPY's semantics (the script a COPY step runs, executed
here by bash on a temporary tree).

The COPY script runs as root on this host against paths under ``tmp_path`` only; owners are
the host's ``daemon`` (a user with a same-name group) and ``nobody:nogroup``.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import subprocess
from pathlib import Path

import pytest

from aenv.orchestrator.builds import copy_owner, copy_script, copy_source_base, extract_command

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
