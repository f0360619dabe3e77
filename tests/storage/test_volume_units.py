"""Units of volumes with no mount and no VM: path parsing of the content API, the NFS
server's configuration, envd's ``volumeMounts`` checks and module order, tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.envd import mounts
from aenv.storage import volume_fs, volume_server
from aenv.store import Database
from aenv.store.volumes import VolumeNameTaken, VolumeStore


@pytest.mark.parametrize("raw, want", [
    ("/", []), ("", []), (".", []), ("/a/b", ["a", "b"]), ("a//b/./c/", ["a", "b", "c"]),
    ("/a/../b", ["b"]), ("/a/b/..", ["a"]), ("/ spaced /x", [" spaced ", "x"]),
])
def test_paths_are_taken_apart_lexically(raw: str, want: list[str]) -> None:
    assert volume_fs.parts(raw) == want


@pytest.mark.parametrize("raw", ["/..", "../x", "/a/../../b", "/a\0b", "/" + "x" * 256])
def test_paths_that_leave_the_root_or_are_malformed_are_refused(raw: str) -> None:
    with pytest.raises(volume_fs.PathError):
        volume_fs.parts(raw)


def test_the_nfs_server_exports_only_what_it_is_given(tmp_path: Path) -> None:
    conf = volume_server.config(tmp_path, [("vol_a", Path("/v/a/root")),
                                           ("vol_b", Path("/v/b/root"))])
    assert conf.count("EXPORT {") == 2
    assert 'Pseudo = "/vol_a";' in conf and 'Path = "/v/b/root";' in conf
    assert "Graceless = true;" in conf and "Protocols = 4;" in conf
    assert "Enable_NLM = false;" in conf and "Attr_Expiration_Time = 0;" in conf
    assert volume_server.export_path("vol_a") == "/vol_a"


def test_envd_checks_volume_mounts() -> None:
    ok = [{"name": "d", "path": "/mnt/d", "nfsTarget": "169.254.0.22:/vol_x", "x": "y"}]
    assert mounts.parse(ok) == [{"name": "d", "path": "/mnt/d",
                                 "nfsTarget": "169.254.0.22:/vol_x"}]
    for bad in ({}, [{"name": "d", "path": "/mnt"}], [{"name": "d", "path": "rel",
                                                      "nfsTarget": "a:/b"}],
                [{"name": "d", "path": "/m", "nfsTarget": "a:/b,nolock"}], [3]):
        with pytest.raises(mounts.MountError):
            mounts.parse(bad)


def test_module_dependencies_come_from_modinfo(tmp_path: Path) -> None:
    root = tmp_path / "6.1.0-x"
    for rel, deps in (("fs/nfs/nfsv4.ko", "nfs,sunrpc"), ("fs/nfs/nfs.ko", "sunrpc"),
                      ("net/sunrpc/sunrpc.ko", ""), ("fs/dns-resolver.ko", "")):
        path = root / "kernel" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x7fELF junk\0license=GPL\0depends=" + deps.encode() + b"\0")
    index = mounts._module_index(root)
    assert set(index) == {"nfsv4", "nfs", "sunrpc", "dns_resolver"}
    assert mounts._depends(index["nfsv4"]) == ["nfs", "sunrpc"]
    assert mounts._depends(index["sunrpc"]) == []


def test_volume_names_are_unique_and_tokens_are_per_volume(tmp_path: Path) -> None:
    store = VolumeStore(Database(tmp_path / "db"))
    a, b = store.insert("a", 16), store.insert("b", 16)
    with pytest.raises(VolumeNameTaken):
        store.insert("a", 16)
    assert a.id != b.id and a.token != b.token and len(a.token) >= 40
    assert a.token_matches(a.token) and not a.token_matches(b.token)
    assert not a.token_matches("") and not a.token_matches(a.token + "x")
    assert store.by_name("b") == b and store.get(a.id) == a
    assert store.delete(a.id) and not store.delete(a.id)
