"""Images with no guest layer of their own boot with the tools drive and behave as ``base``.

Two images built with ``build_image(..., guest_layer="tools")`` from trees made here
(``tools_images``): a static busybox (no libc, no bash, no Python) and a Debian without
Python. A real server (own home, prefix ``aenvtd``) boots them from templates naming
``image:<digest>`` (written into its store: the template builder's ``fromImage`` is not
wired yet), and the real E2B SDK drives envd through its proxy: commands, PTY, files,
watch, the image's own files and shell, a clean environment, and a pause with memory and
resume of the busybox sandbox.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox
from e2b.sandbox.commands.command_handle import PtySize

from aenv.config import Settings
from aenv.storage.images import Image, build_image
from aenv.storage.tools_drive import ensure_tools_drive
from aenv.store import Database, TemplateStore
from aenv.store.records import TemplateRecord
from aenv.store.states import BuildStatus, TemplateKind
from tests.guest.tools_images import busybox_tree, debian_tree
from tests.sdk_checks import assert_watch_sees_a_new_file
from tests.server.conftest import ServerProcess, sdk_pointed_at, serving

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(1200)]

PREFIX = "aenvtd"
BUSYBOX = "aenvtd-busybox"
DEBIAN = "aenvtd-debian"


@pytest.fixture(scope="module")
def tools_images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Image]:
    settings = Settings.from_env()
    trees = tmp_path_factory.mktemp("aenvtd-trees")
    return {
        BUSYBOX: build_image(settings, BUSYBOX, busybox_tree(settings, trees / "busybox"),
                             guest_layer="tools"),
        DEBIAN: build_image(settings, DEBIAN, debian_tree(settings, trees / "debian"),
                            guest_layer="tools"),
    }


def _add_template(home: Path, name: str, image: Image) -> None:
    now = time.time()
    TemplateStore(Database(home / "aenv.db")).insert(TemplateRecord(
        id=name, kind=TemplateKind.TEMPLATE, build_id=f"{name}-build", status=BuildStatus.READY,
        cpu_count=2, memory_mb=512, disk_size_mb=4096, created_at=now, updated_at=now,
        image=f"image:{image.digest}", user="user", names=[name]))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory,
           tools_images: dict[str, Image]) -> Iterator[ServerProcess]:
    home = tmp_path_factory.mktemp("aenvtd-server") / "home"
    with serving(ServerProcess(home, prefix=PREFIX, net=87)) as srv:
        for name, image in tools_images.items():
            _add_template(home, name, image)
        with sdk_pointed_at(srv):
            yield srv


@pytest.fixture(scope="module")
def busybox(server: ServerProcess) -> Iterator[Sandbox]:
    sbx = Sandbox.create(BUSYBOX, timeout=900)
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture(scope="module")
def debian(server: ServerProcess) -> Iterator[Sandbox]:
    sbx = Sandbox.create(DEBIAN, timeout=900)
    try:
        yield sbx
    finally:
        sbx.kill()


def test_aenvtd_busybox_runs_commands_with_its_own_sh(busybox: Sandbox) -> None:
    # (the shell's own command line, read before its last command, which it may exec)
    result = busybox.commands.run(
        "echo hi; id -un; echo $HOME; c=$(tr '\\0' ' ' </proc/$$/cmdline); echo \"$c\"")
    out = result.stdout.splitlines()
    assert result.exit_code == 0
    assert out[:3] == ["hi", "user", "/home/user"]
    assert out[3].startswith("/bin/sh -l -c ")  # no bash in the image: its sh, same flags
    with pytest.raises(CommandExitException) as info:
        busybox.commands.run("exit 7")
    assert info.value.exit_code == 7


def test_aenvtd_busybox_shows_its_own_files_and_the_user(busybox: Sandbox) -> None:
    assert busybox.commands.run("readlink /bin/sh; test -x /bin/busybox && echo yes"
                                ).stdout.split() == ["busybox", "yes"]
    passwd = busybox.files.read("/etc/passwd")
    assert "root:x:0:0:root:/root:/bin/sh" in passwd
    assert "user:x:1000:1000::/home/user:/bin/sh" in passwd
    root = busybox.commands.run("id -u", user="root")
    assert root.stdout.strip() == "0"


def test_aenvtd_files_write_read_list(busybox: Sandbox, debian: Sandbox) -> None:
    for sbx in (busybox, debian):
        sbx.files.write("/home/user/notes/a.txt", "hello from the host\n")
        assert sbx.files.read("/home/user/notes/a.txt") == "hello from the host\n"
        assert [e.name for e in sbx.files.list("/home/user/notes")] == ["a.txt"]
        owner = sbx.commands.run("stat -c %U:%G /home/user/notes/a.txt").stdout.strip()
        assert owner == "user:user"


def test_aenvtd_watch_sees_a_new_file(busybox: Sandbox) -> None:
    assert_watch_sees_a_new_file(busybox, within=10)


@pytest.mark.parametrize("which", ["busybox", "debian"])
def test_aenvtd_pty_runs_the_image_shell(which: str, request: pytest.FixtureRequest) -> None:
    sbx: Sandbox = request.getfixturevalue(which)
    handle = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(handle.pid, b"echo pty-$((6*7)) $(tr '\\0' ' ' </proc/$$/cmdline)\nexit\n")
    out = bytearray()
    result = handle.wait(on_pty=out.extend)
    assert result.exit_code == 0
    text = out.decode(errors="replace")
    assert "pty-42" in text
    assert ("/bin/sh -i -l" if which == "busybox" else "/bin/bash -i -l") in text


def test_aenvtd_debian_has_its_os_release_and_no_python(debian: Sandbox) -> None:
    assert 'ID=debian' in debian.files.read("/etc/os-release")
    assert debian.commands.run("echo $BASH_VERSION").stdout.strip()  # bash: the image has it
    for probe in ("command -v python3", "ls -d /usr/lib/python3*"):
        with pytest.raises(CommandExitException):
            debian.commands.run(probe)


@pytest.mark.parametrize("which", ["busybox", "debian"])
def test_aenvtd_nothing_of_the_tools_leaks_into_commands(which: str,
                                                        request: pytest.FixtureRequest) -> None:
    sbx: Sandbox = request.getfixturevalue(which)
    env = dict(line.split("=", 1) for line in sbx.commands.run("env").stdout.splitlines()
               if "=" in line)
    for name in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONHOME", "PYTHONPATH",
                 "AENV_ENVD_SETPRIV"):
        assert name not in env
    assert "/.aenv" not in env["PATH"]
    # envd itself (the command's parent, as root) maps nothing of the image: no libc, no
    # Python files from outside the tools drive.
    maps = sbx.commands.run("cat /proc/$PPID/maps; readlink /proc/$PPID/exe", user="root")
    files = {line.split()[-1] for line in maps.stdout.splitlines() if "/" in line}
    assert "/.aenv/bin/python3.11" in files
    assert [f for f in files if not f.startswith(("/.aenv/", "/dev/", "/memfd:"))] == []


def test_aenvtd_the_tools_drive_is_mounted_read_only(busybox: Sandbox) -> None:
    mounts = {line.split()[1]: line.split() for line in
              busybox.files.read("/proc/mounts").splitlines()}
    assert mounts["/.aenv"][0] == "/dev/vdb"
    assert "ro" in mounts["/.aenv"][3].split(",")
    assert mounts["/"][0] == "/dev/vda"
    with pytest.raises(CommandExitException):
        busybox.commands.run("touch /.aenv/x", user="root")


def test_aenvtd_busybox_pauses_and_resumes_with_its_memory(busybox: Sandbox,
                                                          server: ServerProcess) -> None:
    busybox.commands.run("echo kept > /home/user/before-pause; sleep 3600 >/dev/null 2>&1 &")
    assert busybox.pause()
    # The snapshot names the shared tools drive by its path (read-only: never copied).
    tools = ensure_tools_drive(Settings.from_env())
    captured = [{d["id"]: d for d in json.loads(m.read_text())["drives"]}
                for m in (server.home / "snapshots").glob("*/snapshot.json")]
    (drives,) = [d for d in captured if "tools" in d]  # the pause's (not base's snapshot)
    assert drives["tools"]["read_only"] is True
    assert Path(drives["tools"]["path"]) == tools.path.resolve()
    assert drives["rootfs"]["read_only"] is False
    resumed = Sandbox.connect(busybox.sandbox_id, timeout=900)
    assert resumed.files.read("/home/user/before-pause") == "kept\n"
    result = resumed.commands.run("echo after-resume; pidof sleep >/dev/null && echo alive")
    assert result.stdout.split() == ["after-resume", "alive"]
