"""Volumes through the newest E2B JavaScript SDK (``tests/js/volumes.mjs``) against
``aenv server`` with a real microVM: ``Volume.create/connect/getInfo/list/destroy``, the
volume's file methods (``makeDir``, ``writeFile``, ``readFile`` as text and bytes,
``list``, ``exists``, ``getInfo``, ``updateMetadata``, ``remove``) and the errors they
raise, and ``Sandbox.create({volumeMounts})`` with a command reading what the API wrote
and writing what the API then reads."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import ROOT, run_json_script

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.js, pytest.mark.timeout(600)]


def test_volumes_through_the_js_sdk(sdk) -> None:
    if shutil.which("node") is None or not (ROOT / "tests/js/node_modules/e2b").is_dir():
        pytest.fail("node or the e2b npm package is missing: run ./scripts/setup.sh")
    out = run_json_script(["node", "volumes.mjs"], {
        "E2B_API_KEY": sdk.api_key, "E2B_API_URL": sdk.url, "E2B_SANDBOX_URL": sdk.url,
        "E2B_VOLUME_API_URL": sdk.url}, cwd=ROOT / "tests/js", timeout=500)
    assert out["created"] == {"name": "js-volume", "id": True, "token": True}
    assert out["dir"] == "directory"
    assert out["stat"] == {"name": "hello.txt", "type": "file", "size": 16, "mode": 0o640,
                           "uid": 1000, "mtime": True}
    assert out["read"] == "from the js sdk\n" and out["bytes"] == 16
    assert out["listed"] == ["hello.txt"]
    assert out["exists"] == [True, False]
    assert out["overwrite"][0] == "VolumeError" and "409" in out["overwrite"][1]
    assert out["missing"][0] == "VolumePathNotFoundError"
    assert out["mode"] == 0o600
    assert out["connected"] == out["info"] == "js-volume" and out["inList"] is True
    assert out["guestRead"] == "from the js sdk\n"
    assert out["apiRead"] == "from-the-guest\n"
    assert out["mounts"] == [{"name": "js-volume", "path": "/mnt/js"}]
    assert out["removed"] is True
    assert out["destroyed"] == [True, False]
    assert out["gone"][0] == "VolumeNotFoundError"
