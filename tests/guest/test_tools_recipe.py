"""The tools drive's parts without a VM: ELF reading, the user, image references, the boot
arguments, the shell fallback, which disks boot with the drive, and the scripts agreeing
with the recipe's constants."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.envd.process.launch import shell_for
from aenv.guest import tools
from aenv.guest.bootargs import guest_boot_args
from aenv.storage import elf, guest_user, tools_drive
from aenv.storage.errors import ImageError
from aenv.storage.image_ref import BadImageRef, ImageKind, ImageRef
from aenv.storage.kernel import Kernel

DIGEST = "ab" * 32


# -- elf ------------------------------------------------------------------------------------


def test_needed_reads_the_dt_needed_entries_of_a_real_binary() -> None:
    names = elf.needed(Path(os.path.realpath(sys.executable)))
    assert "libc.so.6" in names or any(n.startswith("libpython3") for n in names)


def test_needed_refuses_what_is_not_elf(tmp_path: Path) -> None:
    script = tmp_path / "x.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(elf.ElfError, match="not an ELF"):
        elf.needed(script)


def test_closure_follows_libraries_through_each_other_and_names_a_missing_one(
        tmp_path: Path) -> None:
    """A tree holding the host's libc family: the closure of ls ends in the loader; with
    libc gone from the tree the error names the file that wanted it."""
    ls = Path(shutil.which("ls") or "/bin/ls")
    tree = tmp_path / "tree"
    libdir = tree / "lib/x86_64-linux-gnu"
    libdir.mkdir(parents=True)
    host = {n: p for n, p in elf.closure(Path("/"), [Path(os.path.realpath(ls))]).items()}
    for name, path in host.items():
        shutil.copy(os.path.realpath(path), libdir / name)
    found = elf.closure(tree, [Path(os.path.realpath(ls))])
    assert set(found) == set(host)
    assert "libc.so.6" in found and all(p.is_relative_to(tree) for p in found.values())
    (libdir / "libc.so.6").unlink()
    with pytest.raises(elf.ElfError, match=r"libc\.so\.6, needed by"):
        elf.closure(tree, [Path(os.path.realpath(ls))])


# -- the user -------------------------------------------------------------------------------


def _etc(tree: Path, passwd: str, group: str, shadow: str | None = None) -> None:
    (tree / "etc").mkdir(parents=True)
    (tree / "etc/passwd").write_text(passwd)
    (tree / "etc/group").write_text(group)
    if shadow is not None:
        (tree / "etc/shadow").write_text(shadow)
        os.chmod(tree / "etc/shadow", 0o640)


@pytest.mark.skipif(os.geteuid() != 0, reason="chowns the home to uid 1000")
def test_add_user_writes_passwd_group_shadow_and_home(tmp_path: Path) -> None:
    _etc(tmp_path, "root:x:0:0:root:/root:/bin/sh\n", "root:x:0:\n", "root:*:19000:0:::::\n")
    (tmp_path / "bin").mkdir()
    os.symlink("busybox", tmp_path / "bin/sh")
    user = guest_user.add_user(tmp_path, "user")
    assert (user.uid, user.gid, user.home, user.shell, user.created) == (
        1000, 1000, "/home/user", "/bin/sh", True)
    assert (tmp_path / "etc/passwd").read_text().splitlines()[-1] == \
        "user:x:1000:1000::/home/user:/bin/sh"
    assert "user:x:1000:" in (tmp_path / "etc/group").read_text()
    assert (tmp_path / "etc/shadow").read_text().splitlines()[-1].startswith("user:!:")
    assert (os.stat(tmp_path / "etc/shadow").st_mode & 0o777) == 0o640
    st = os.stat(tmp_path / "home/user")
    assert (st.st_uid, st.st_gid) == (1000, 1000)


@pytest.mark.skipif(os.geteuid() != 0, reason="chowns the home")
def test_add_user_keeps_an_existing_user_and_skips_taken_ids(tmp_path: Path) -> None:
    _etc(tmp_path, "root:x:0:0::/root:/bin/sh\nnode:x:1000:1000::/home/node:/bin/bash\n",
         "root:x:0:\nnode:x:1000:\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/bash").write_text("")
    user = guest_user.add_user(tmp_path, "user")
    assert (user.uid, user.gid, user.shell) == (1001, 1001, "/bin/bash")
    assert not (tmp_path / "etc/shadow").exists()  # the image had none: none is made
    again = guest_user.add_user(tmp_path, "user")
    assert (again.uid, again.created) == (1001, False)
    rows = (tmp_path / "etc/passwd").read_text().splitlines()
    assert [r for r in rows if r.startswith("user:")] == ["user:x:1001:1001::/home/user:/bin/bash"]


def test_add_user_refuses_a_bad_name(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="bad user name"):
        guest_user.add_user(tmp_path, "a:b")


# -- references and boot arguments ----------------------------------------------------------


def test_image_references_name_a_whole_digest() -> None:
    ref = ImageRef.parse(f"image:{DIGEST}")
    assert (ref.kind, ref.id, ref.is_image, str(ref)) == (ImageKind.IMAGE, DIGEST, True,
                                                          f"image:{DIGEST}")
    for bad in ("image:", "image:abc", f"image:{DIGEST.upper()}", f"image:../{DIGEST}"):
        with pytest.raises(BadImageRef):
            ImageRef.parse(bad)


def _kernel(tmp_path: Path, initrd: bool) -> Kernel:
    return Kernel("cloud", "6.1.0-test", tmp_path / "vmlinux",
                  tmp_path / "initrd.img" if initrd else None)


def test_boot_args_with_the_tools_drive(tmp_path: Path) -> None:
    args = guest_boot_args(_kernel(tmp_path, True), tools=True).split()
    assert "init=/.aenv/bin/aenv-init" in args and "aenv.tools=/dev/vdb" in args
    assert "root=/dev/vda" in args
    fallback = guest_boot_args(_kernel(tmp_path, True), tools="fallback").split()
    assert "init=/sbin/aenv-init" in fallback and "aenv.tools=/dev/vdb" in fallback
    plain = guest_boot_args(_kernel(tmp_path, True)).split()
    assert "init=/sbin/aenv-init" in plain and not any("aenv.tools" in a for a in plain)
    with pytest.raises(ValueError, match="no initramfs"):
        guest_boot_args(_kernel(tmp_path, False), tools=True)


# -- the shell fallback ---------------------------------------------------------------------


def test_bash_becomes_sh_with_its_flags_where_there_is_no_bash(tmp_path: Path) -> None:
    missing = str(tmp_path / "bash")
    assert shell_for("/bin/bash", ["-l", "-c", "echo --login"], missing) == (
        "/bin/sh", ["-l", "-c", "echo --login"])
    assert shell_for("/bin/bash", ["-i", "-l"], missing) == ("/bin/sh", ["-i", "-l"])
    assert shell_for("/bin/bash", ["--login", "--norc", "-c", "x", "a"], missing) == (
        "/bin/sh", ["-l", "-c", "x", "a"])
    assert shell_for("/usr/bin/env", ["bash"], missing) == ("/usr/bin/env", ["bash"])
    present = tmp_path / "real-bash"
    present.write_text("")
    assert shell_for("/bin/bash", ["-l", "-c", "x"], str(present)) == (
        "/bin/bash", ["-l", "-c", "x"])


# -- which disks boot with the drive --------------------------------------------------------


def _image_dir(settings: Settings, digest: str, boot: str) -> Path:
    d = settings.images_dir / digest
    d.mkdir(parents=True)
    (d / "rootfs.ext4").write_bytes(b"")
    (d / "image.json").write_text(json.dumps({
        "name": "t", "digest": digest, "rootfs": "rootfs.ext4", "kernel_flavor": "cloud",
        "size_bytes": 0, "boot": boot}))
    return d / "rootfs.ext4"


@pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")
def test_disk_uses_tools_follows_layers_and_qcow2_backing_files(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", cache_home=tmp_path / "artifacts")
    tools_image = _image_dir(settings, "a" * 64, "tools")
    base_image = _image_dir(settings, "b" * 64, "guest-layer")
    assert tools_drive.disk_uses_tools(settings, tools_image) is True
    assert tools_drive.disk_uses_tools(settings, base_image) is False
    layers = settings.layers_dir
    layers.mkdir(parents=True)
    (layers / "l1.raw").write_bytes(b"\0" * 4096)
    (layers / "l1.json").write_text(json.dumps({"id": "l1", "format": "raw",
                                                "base": str(tools_image)}))
    assert tools_drive.disk_uses_tools(settings, layers / "l1.raw") is True
    overlay = tmp_path / "snap.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(layers / "l1.raw"),
                    "-F", "raw", str(overlay)], check=True)
    assert tools_drive.qcow2_backing(overlay) == layers / "l1.raw"
    assert tools_drive.disk_uses_tools(settings, overlay) is True
    raw = tmp_path / "disk.raw"
    raw.write_bytes(b"\0" * 4096)
    assert tools_drive.qcow2_backing(raw) is None
    assert tools_drive.disk_uses_tools(settings, raw) is None  # no chain: the guest decides


# -- the scripts and the recipe -------------------------------------------------------------


def test_the_scripts_run_python_and_setpriv_as_the_recipe_says() -> None:
    files = {f.path: f.data.decode() for f in tools.scripts()}
    supervise = files["bin/envd-supervise"].replace("$T", tools.PREFIX).replace("\\\n    ", "")
    assert " ".join(tools.PYTHON_ARGV) in supervise
    assert f'{tools.SETPRIV_ENV}="{" ".join(tools.SETPRIV_ARGV)}"' in supervise
    init = files["bin/aenv-init"]
    assert init.startswith(f"#!{tools.PREFIX}/bin/sh\n")
    assert f"export PATH={tools.GUEST_PATH}\n" in init
    code = [line for line in (supervise + init).splitlines() if not line.startswith("#")]
    assert not [line for line in code if "LD_LIBRARY_PATH" in line or "PYTHON" in line]


# -- the node's decision --------------------------------------------------------------------


def test_the_node_attaches_the_drive_to_tools_images_only(tmp_path: Path) -> None:
    from aenv.orchestrator.errors import InvalidRequest
    from aenv.orchestrator.node import NodeMachines

    settings = Settings(home=tmp_path / "home", cache_home=tmp_path / "artifacts",
                        name_prefix="aenvtdu")
    machines = NodeMachines(settings)
    tools_image = _image_dir(settings, "a" * 64, "tools")
    plain_image = _image_dir(settings, "b" * 64, "guest-layer")
    machines.kernel = _kernel(tmp_path, True)
    tools_ref, plain_ref = ImageRef.image("a" * 64), ImageRef.image("b" * 64)
    assert machines._image_for(tools_ref) == tools_image
    assert machines._tools_boot(tools_ref, tools_image) is True
    assert machines._tools_boot(plain_ref, plain_image) is False
    assert machines._tools_boot(ImageRef.parse(None), plain_image) is False
    raw = tmp_path / "disk.raw"
    raw.write_bytes(b"")
    assert machines._tools_boot(ImageRef.snapshot("s1"), raw) == "fallback"
    with pytest.raises(InvalidRequest, match="no image with digest"):
        machines._image_for(ImageRef.image("c" * 64))
    machines.kernel = _kernel(tmp_path, False)  # the small kernel
    with pytest.raises(InvalidRequest, match="cloud kernel"):
        machines._tools_boot(tools_ref, tools_image)
    assert machines._tools_boot(ImageRef.snapshot("s1"), raw) is False


# -- building a tools image -----------------------------------------------------------------


def _debugfs(image: Path, request: str) -> str:
    return subprocess.run(["debugfs", "-R", request, str(image)], check=True,
                          capture_output=True, text=True).stdout


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("debugfs") is None,
                    reason="building images needs root; reading them needs debugfs")
def test_a_tools_image_from_an_oci_image_gets_the_user_and_the_mountpoint(
        tmp_path: Path) -> None:
    import tarfile

    from aenv.storage.images import build_image
    from aenv.storage.oci import OciImage

    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (tree / "etc/group").write_text("root:x:0:\n")
    (tree / "hello.txt").write_text("from the layer\n")
    layer = tmp_path / "layer.tar"
    with tarfile.open(layer, "w") as tar:
        tar.add(tree, arcname=".")
    settings = Settings(home=tmp_path / "home", cache_home=tmp_path / "artifacts")
    image = build_image(settings, "t", OciImage(f"sha256:{DIGEST}", [layer]),
                        guest_layer="tools", size_bytes=64 << 20)
    assert image.uses_tools and image.source == f"oci sha256:{DIGEST}"
    assert "user:x:1000:1000::/home/user:/bin/sh" in _debugfs(image.path, "cat /etc/passwd")
    assert "from the layer" in _debugfs(image.path, "cat /hello.txt")
    root = _debugfs(image.path, "ls -l /")
    for name in (".aenv", "proc", "sys", "dev", "run", "tmp", "home"):
        assert f" {name}" in root, name
    assert "1000" in _debugfs(image.path, "stat /home/user")
    again = build_image(settings, "t", OciImage(f"sha256:{DIGEST}", [layer]),
                        guest_layer="tools", size_bytes=64 << 20)
    assert again.digest == image.digest  # a cache hit
    with pytest.raises(ImageError, match="cloud kernel"):
        build_image(settings, "t", tree, guest_layer="tools", kernel_flavor="small")
