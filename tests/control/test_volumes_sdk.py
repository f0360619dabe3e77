"""E2B's Python SDK ``Volume`` against a real aenv server (host-process sandboxes, real
loop-mounted volume images): every call of spec part 2 sections 4.1-4.2 and the
exceptions the SDK raises from our answers."""

from __future__ import annotations

import io
import os

import pytest
from e2b import Volume
from e2b.exceptions import (
    AuthenticationException,
    VolumeException,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root")


@pytest.fixture
def volume_env(api_env, server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("E2B_VOLUME_API_URL", server.url)
    return api_env


def test_volume_calls_through_the_sdk(volume_env) -> None:
    vol = Volume.create("sdk-volume")
    try:
        assert vol.volume_id.startswith("vol_") and vol.name == "sdk-volume" and vol.token
        assert [(v.volume_id, v.name) for v in Volume.list()] == [(vol.volume_id,
                                                                    "sdk-volume")]
        again = Volume.connect(vol.volume_id)
        assert (again.name, again.token) == ("sdk-volume", vol.token)
        with pytest.raises(VolumeException, match="409"):
            Volume.create("sdk-volume")

        st = vol.write_file("/dir/a.txt", "hello", mode=0o644)
        assert (st.name, st.path, st.size, st.mode) == ("a.txt", "/dir/a.txt", 5, 0o644)
        assert st.type.value == "file"
        assert vol.read_file("/dir/a.txt") == "hello"
        assert vol.read_file("/dir/a.txt", format="bytes") == b"hello"
        assert b"".join(vol.read_file("/dir/a.txt", format="stream")) == b"hello"
        with pytest.raises(VolumeException, match="409"):
            vol.write_file("/dir/a.txt", "again")
        vol.write_file("/dir/a.txt", "again", force=True, uid=1000, gid=1000, mode=0o600)
        info = vol.get_info("/dir/a.txt")
        assert (info.uid, info.gid, info.mode, info.size) == (1000, 1000, 0o600, 5)
        big = os.urandom(2 * 1024 * 1024 + 17)
        vol.write_file("/big.bin", io.BytesIO(big))  # a file object: streamed
        assert vol.read_file("/big.bin", format="bytes") == big

        vol.make_dir("/p/q", force=True, mode=0o700)
        with pytest.raises(VolumeException, match="409"):
            vol.make_dir("/p/q")
        with pytest.raises(VolumePathNotFoundException):
            vol.make_dir("/x/y")
        names = sorted(e.name for e in vol.list("/"))
        assert names == ["big.bin", "dir", "p"]
        assert {e.path for e in vol.list("/", depth=3)} == {
            "/big.bin", "/dir", "/dir/a.txt", "/p", "/p/q"}
        assert vol.exists("/p/q") and not vol.exists("/nope")
        updated = vol.update_metadata("/dir/a.txt", mode=0o640)
        assert updated.mode == 0o640
        with pytest.raises(VolumePathNotFoundException):
            vol.update_metadata("/nope", mode=0o600)
        vol.remove("/p")
        assert not vol.exists("/p/q")
        with pytest.raises(VolumePathNotFoundException):
            vol.remove("/p")
        with pytest.raises(VolumePathNotFoundException):
            vol.get_info("/p")

        wrong = Volume(vol.volume_id, vol.name, token="not-the-token")
        with pytest.raises(AuthenticationException):
            wrong.list("/")
    finally:
        assert Volume.destroy(vol.volume_id) is True
    assert Volume.destroy(vol.volume_id) is False
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vol.volume_id)
