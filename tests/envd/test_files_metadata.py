"""File metadata: ``X-Metadata-*`` on upload, ``user.e2b.*`` xattrs on disk, EntryInfo.metadata."""

from __future__ import annotations

import os


def _xattrs(path: str) -> dict[str, bytes]:
    return {n: os.getxattr(path, n) for n in os.listxattr(path) if n.startswith("user.e2b.")}


def test_upload_metadata_lands_in_lowercased_xattrs(sandbox, home_dir):
    info = sandbox.files.write(f"{home_dir}/f", "x", metadata={"Owner": "alice", "stage": "raw"})
    assert info.metadata == {"owner": "alice", "stage": "raw"}
    assert _xattrs(f"{home_dir}/f") == {"user.e2b.owner": b"alice", "user.e2b.stage": b"raw"}
    assert sandbox.files.get_info(f"{home_dir}/f").metadata == {"owner": "alice", "stage": "raw"}


def test_overwrite_replaces_the_whole_metadata_set(sandbox, home_dir):
    sandbox.files.write(f"{home_dir}/f", "x", metadata={"a": "1", "b": "2"})
    sandbox.files.write(f"{home_dir}/f", "y", metadata={"b": "3"})
    assert sandbox.files.get_info(f"{home_dir}/f").metadata == {"b": "3"}
    info = sandbox.files.write(f"{home_dir}/f", "z")
    assert info.metadata is None and _xattrs(f"{home_dir}/f") == {}


def test_metadata_applies_to_every_file_of_a_multi_file_upload(sandbox, home_dir):
    infos = sandbox.files.write_files(
        [{"path": f"{home_dir}/a", "data": "1"}, {"path": f"{home_dir}/b", "data": "2"}],
        metadata={"batch": "7"},
    )
    assert [i.metadata for i in infos] == [{"batch": "7"}] * 2


def test_out_of_band_xattrs_show_in_stat_and_list(sandbox, home_dir):
    sandbox.files.write(f"{home_dir}/f", "x")
    os.setxattr(f"{home_dir}/f", "user.e2b.source", b"setfattr")
    os.setxattr(f"{home_dir}/f", "user.other", b"not ours")
    assert sandbox.files.get_info(f"{home_dir}/f").metadata == {"source": "setfattr"}
    (entry,) = sandbox.files.list(home_dir)
    assert entry.metadata == {"source": "setfattr"}


async def test_async_metadata_round_trip(async_sandbox, home_dir):
    info = await async_sandbox.files.write(f"{home_dir}/f", b"x", metadata={"k": "v"})
    assert info.metadata == {"k": "v"}
    assert (await async_sandbox.files.get_info(f"{home_dir}/f")).metadata == {"k": "v"}
