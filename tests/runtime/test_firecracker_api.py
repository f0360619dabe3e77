"""The Firecracker API client and its request builders, against the published v1.16.1 API.

These tests prove the wire contract only: each body the builders make is one the v1.16.1
schema accepts, and the client maps Firecracker's replies (204, 200 JSON, 400 with
``fault_message``, no socket) to results and errors. No Firecracker runs here.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import jsonschema
import pytest

from aenv.runtime import ControlError
from aenv.runtime import firecracker_api as fc
from tests.runtime.firecracker_contract import check_request

BUILDERS: dict[str, Callable[[], fc.Request]] = {
    "version": fc.get_version,
    "describe": fc.describe_instance,
    "logger": lambda: fc.put_logger("Info"),
    "metrics": lambda: fc.put_metrics("metrics.json"),
    "serial": lambda: fc.put_serial("console.log"),
    "machine": lambda: fc.put_machine_config(2, 512, track_dirty_pages=True),
    "boot": lambda: fc.put_boot_source("kernel", "console=ttyS0", "initrd"),
    "boot-no-initrd": lambda: fc.put_boot_source("kernel", "console=ttyS0"),
    "root drive": lambda: fc.put_drive("rootfs", "rootfs.raw", is_root_device=True,
                                       is_read_only=False),
    "data drive": lambda: fc.put_drive("data", "data.raw", is_root_device=False,
                                       is_read_only=True),
    "net": lambda: fc.put_network_interface("eth0", "tap0", "02:fc:00:00:00:21"),
    "entropy": fc.put_entropy,
    "start": fc.instance_start,
    "pause": lambda: fc.patch_vm("Paused"),
    "resume": lambda: fc.patch_vm("Resumed"),
    "full": lambda: fc.create_snapshot("s/vmstate", "s/memory", "Full"),
    "diff": lambda: fc.create_snapshot("s/vmstate", "s/memory", "Diff"),
    "load": lambda: fc.load_snapshot("s/vmstate", "s/memory", track_dirty_pages=True,
                                     resume_vm=True, network_overrides=[("eth0", "tap3")]),
    "load-same-tap": lambda: fc.load_snapshot("s/vmstate", "s/memory",
                                              track_dirty_pages=False, resume_vm=False),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_request_builder_conforms_to_the_v1_16_1_api_contract(name: str) -> None:
    request = BUILDERS[name]()
    check_request(request.method, request.path, request.body)


def test_the_schema_check_fails_on_a_misspelled_field_a_wrong_type_or_a_mismatched_id() -> None:
    with pytest.raises(jsonschema.ValidationError, match="track_dirty_page"):
        check_request("PUT", "/machine-config",
                      {"vcpu_count": 1, "mem_size_mib": 128, "track_dirty_page": True})
    with pytest.raises(jsonschema.ValidationError):
        check_request("PUT", "/machine-config", {"vcpu_count": "1", "mem_size_mib": 128})
    with pytest.raises(AssertionError, match="drive_id"):
        check_request("PUT", "/drives/rootfs", {"drive_id": "root", "path_on_host": "r",
                                                "is_root_device": True, "is_read_only": False})
    with pytest.raises(jsonschema.ValidationError):  # both memory sources at once
        check_request("PUT", "/snapshot/load", {"snapshot_path": "v", "mem_file_path": "m",
                                                "mem_backend": {"backend_type": "File",
                                                                "backend_path": "m"}})
    with pytest.raises(AssertionError, match="not an operation"):
        check_request("PUT", "/vm", {"state": "Paused"})


def test_load_names_the_file_backend_and_sends_overrides_only_when_given() -> None:
    with_tap = fc.load_snapshot("v", "m", track_dirty_pages=True, resume_vm=True,
                                network_overrides=[("eth0", "tap3")]).body
    assert with_tap is not None
    assert with_tap["mem_backend"] == {"backend_type": "File", "backend_path": "m"}
    assert with_tap["network_overrides"] == [{"iface_id": "eth0", "host_dev_name": "tap3"}]
    plain = fc.load_snapshot("v", "m", track_dirty_pages=True, resume_vm=True).body
    assert plain is not None and "network_overrides" not in plain


def test_versions_parse_with_or_without_prefix_and_suffix() -> None:
    assert fc.parse_version("1.16.1") == (1, 16, 1)
    assert fc.parse_version("v1.17.0-dev") == (1, 17, 0)
    assert fc.parse_version("1.14") == (1, 14, 0)
    with pytest.raises(ValueError):
        fc.parse_version("banana")


# -- the client against a unix-socket HTTP server written here ------------------------------


class TinyServer:
    """Answers every request with one canned HTTP reply and remembers what it got."""

    def __init__(self, status: int, body: object | None) -> None:
        self.status, self.body = status, body
        self.seen: list[tuple[str, str, object]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        method, path, _ = lines[0].split(" ")
        headers = dict(ln.split(": ", 1) for ln in lines[1:] if ": " in ln)
        length = int(headers.get("Content-Length", headers.get("content-length", "0")))
        raw = await reader.readexactly(length) if length else b""
        self.seen.append((method, path, json.loads(raw) if raw else None))
        data = json.dumps(self.body).encode() if self.body is not None else b""
        writer.write(f"HTTP/1.1 {self.status} X\r\nContent-Length: {len(data)}\r\n"
                     "Connection: close\r\n\r\n".encode() + data)
        await writer.drain()
        writer.close()


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    servers: list[asyncio.AbstractServer] = []

    async def start(status: int, body: object | None, sock: Path | None = None):
        sock = sock or tmp_path / "api.sock"
        tiny = TinyServer(status, body)
        servers.append(await asyncio.start_unix_server(tiny.handle, path=str(sock)))
        return tiny, fc.FirecrackerAPI(sock, vm_id="vm1")

    yield start
    for s in servers:
        s.close()
        await s.wait_closed()


async def test_a_400_reply_raises_api_error_carrying_firecrackers_fault_message(serve) -> None:
    tiny, api = await serve(400, {"fault_message": "Invalid block device path: rootfs.raw"})
    try:
        with pytest.raises(fc.FirecrackerAPIError) as err:
            await api.send(fc.put_drive("rootfs", "rootfs.raw", is_root_device=True,
                                        is_read_only=False))
    finally:
        await api.aclose()
    e = err.value
    assert isinstance(e, ControlError)
    assert (e.status, e.method, e.path) == (400, "PUT", "/drives/rootfs")
    assert e.fault_message == "Invalid block device path: rootfs.raw"
    assert e.vm_id == "vm1" and "Invalid block device path" in str(e)
    assert tiny.seen[0][2]["path_on_host"] == "rootfs.raw"


async def test_204_gives_none_and_200_gives_the_decoded_json(serve, tmp_path: Path) -> None:
    _, api = await serve(204, None)
    try:
        assert await api.send(fc.patch_vm("Paused")) is None
    finally:
        await api.aclose()
    _, api = await serve(200, {"firecracker_version": "1.16.1"}, tmp_path / "b.sock")
    try:
        assert await api.send(fc.get_version()) == {"firecracker_version": "1.16.1"}
    finally:
        await api.aclose()


async def test_a_missing_socket_raises_api_connection_error(tmp_path: Path) -> None:
    api = fc.FirecrackerAPI(tmp_path / "nobody.sock")
    try:
        with pytest.raises(fc.APIConnectionError):
            await api.send(fc.get_version())
    finally:
        await api.aclose()


async def test_the_client_reaches_a_socket_deeper_than_sun_path_allows(serve, tmp_path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    sock = deep / "firecracker.sock"
    assert len(str(sock)) > 108
    # bind through a short relative path, as Firecracker does from its cwd
    old = Path.cwd()
    os.chdir(deep)
    try:
        _, api = await serve(200, {"firecracker_version": "1.16.1"}, Path("firecracker.sock"))
    finally:
        os.chdir(old)
    await api.aclose()
    api = fc.FirecrackerAPI(sock)
    try:
        assert (await api.send(fc.get_version()))["firecracker_version"] == "1.16.1"
    finally:
        await api.aclose()
