"""The VM working directory: fixed names linked to the spec's files, RAM file, removal."""

from __future__ import annotations

import os
from pathlib import Path

from aenv.runtime import workdir as wd
from aenv.runtime.base import Drive, VMSpec


def make_spec(tmp_path: Path, **kw) -> VMSpec:
    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    for name in ("vmlinux", "initrd.img", "base.raw"):
        (shared / name).write_bytes(name.encode())
    work = tmp_path / "vm"
    work.mkdir(exist_ok=True)
    (work / "rootfs.qcow2").write_bytes(b"overlay")
    args = {
        "vm_id": "v1", "workdir": work, "boot_args": "", "memory_mib": 32,
        "kernel": shared / "vmlinux", "initrd": shared / "initrd.img",
        "memory_file": tmp_path / "ram" / "v1.mem",
        "drives": (Drive("rootfs", work / "rootfs.qcow2", format="qcow2"),
                   Drive("extra", shared / "base.raw", read_only=True)),
    }
    args.update(kw)
    return VMSpec(**args)


def test_prepare_links_every_fixed_name_to_the_spec_files(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    wd.prepare(spec)
    w = spec.workdir
    assert (w / "kernel").read_bytes() == b"vmlinux"
    assert (w / "initrd").read_bytes() == b"initrd.img"
    assert (w / "extra.raw").read_bytes() == b"base.raw"
    # a disk already under its fixed name is used in place, not replaced by a link
    assert not (w / "rootfs.qcow2").is_symlink()
    assert (w / "rootfs.qcow2").read_bytes() == b"overlay"


def test_guest_ram_file_exists_at_full_size_before_the_vmm_starts(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    wd.prepare(spec)
    assert os.path.getsize(spec.workdir / "memory") == 32 << 20
    assert (spec.workdir / "memory").resolve() == spec.memory_file


def test_remove_deletes_the_directory_and_the_ram_file(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    wd.prepare(spec)
    wd.remove(spec.workdir)
    assert not spec.workdir.exists() and not spec.memory_file.exists()
    assert (tmp_path / "shared" / "base.raw").exists()  # shared files are left alone


def test_console_log_elsewhere_is_linked_in(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, console_log=tmp_path / "logs" / "v1.log")
    wd.prepare(spec)
    (spec.workdir / "console.log").write_text("hello\n")
    assert (tmp_path / "logs" / "v1.log").read_text() == "hello\n"


def test_ram_goes_to_tmpfs_when_the_host_has_one(tmp_path: Path) -> None:
    path = wd.default_memory_file("v9", tmp_path)
    if wd._is_tmpfs(wd.SHM):
        assert path == wd.SHM / "aenv-vm-v9.mem"
    else:
        assert path == tmp_path / "memory"


def test_tail_returns_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert wd.tail(log, 2) == "line 98\nline 99"
    assert wd.tail(tmp_path / "missing") == ""
