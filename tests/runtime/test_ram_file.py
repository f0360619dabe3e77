"""Guest-RAM files (``workdir.create_memory_file``, made by ``workdir.prepare``): 0600 and
ours whatever the umask, never through a planted symlink or onto another user's file in the
world-writable ``/dev/shm``, a crashed VM's own stale file replaced."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from aenv.runtime import VMError
from aenv.runtime import workdir as wd
from aenv.runtime.base import VMSpec


def spec(tmp_path: Path, memory_file: Path) -> VMSpec:
    (tmp_path / "vmlinux").write_bytes(b"k")
    return VMSpec(vm_id="v1", workdir=tmp_path / "vm", kernel=tmp_path / "vmlinux",
                  boot_args="", memory_mib=32, memory_file=memory_file)


def test_a_new_ram_file_is_0600_and_ours_at_full_size(tmp_path) -> None:
    old = os.umask(0)
    try:
        wd.prepare(spec(tmp_path, tmp_path / "ram" / "v1.mem"))
    finally:
        os.umask(old)
    st = os.stat(tmp_path / "ram" / "v1.mem")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert st.st_size == 32 << 20 and st.st_blocks == 0


def test_a_planted_symlink_is_refused_and_its_target_left_alone(tmp_path) -> None:
    victim = tmp_path / "precious"
    victim.write_bytes(b"do not truncate")
    ram = tmp_path / "v1.mem"
    ram.symlink_to(victim)
    with pytest.raises(VMError, match="not a guest-RAM file of ours"):
        wd.prepare(spec(tmp_path, ram))
    assert victim.read_bytes() == b"do not truncate" and ram.is_symlink()


def test_a_dangling_symlink_is_refused_too(tmp_path) -> None:
    ram = tmp_path / "v1.mem"
    ram.symlink_to(tmp_path / "would-be-created")
    with pytest.raises(VMError):
        wd.create_memory_file(ram, 1 << 20)
    assert not (tmp_path / "would-be-created").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another user")
def test_another_users_file_under_the_name_is_refused(tmp_path) -> None:
    ram = tmp_path / "v1.mem"
    ram.write_bytes(b"theirs")
    os.chown(ram, 65534, 65534)
    with pytest.raises(VMError, match="uid 65534"):
        wd.create_memory_file(ram, 1 << 20)
    assert ram.read_bytes() == b"theirs"


def test_a_stale_file_of_ours_is_replaced_by_a_fresh_one(tmp_path) -> None:
    ram = tmp_path / "v1.mem"
    ram.write_bytes(b"old guest memory")
    os.chmod(ram, 0o644)
    wd.create_memory_file(ram, 1 << 20)
    st = os.stat(ram)
    assert st.st_size == 1 << 20 and stat.S_IMODE(st.st_mode) == 0o600
    with open(ram, "rb") as f:
        assert f.read(16) == b"\0" * 16  # nothing of the old contents
