"""The proxy forwards to any port of a sandbox: plain HTTP, WebSocket, and E2B's 502 when
nothing listens there (sandboxes here are host envd processes on 127.0.0.N)."""

from __future__ import annotations

import sys
import time

import httpx
import pytest
import websockets.sync.client as ws_client
from e2b import Sandbox

ECHO = """
import asyncio, sys, websockets
async def echo(ws):
    async for m in ws:
        await ws.send(m)
async def main():
    async with websockets.serve(echo, sys.argv[1], int(sys.argv[2])):
        await asyncio.Future()
asyncio.run(main())
"""


@pytest.fixture
def sbx(api_env, server):
    s = Sandbox.create("base")
    yield s, server.server.sandboxes.get(s.sandbox_id).host_ip
    s.kill()


def _wait_port(url: str, headers: dict) -> httpx.Response:
    deadline = time.monotonic() + 15
    while True:
        r = httpx.get(url, headers=headers)
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_http_to_another_guest_port(sbx, server, tmp_path) -> None:
    s, ip = sbx
    (tmp_path / "hello.txt").write_text("served from the sandbox")
    s.commands.run(f"cd {tmp_path} && {sys.executable} -m http.server 8123 --bind {ip}",
                   background=True, user="root")
    r = _wait_port(server.url + "/hello.txt",
                   {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8123"})
    assert r.status_code == 200 and r.text == "served from the sandbox"
    by_host = httpx.get(server.url + "/hello.txt",
                        headers={"Host": f"8123-{s.sandbox_id}.localhost"})
    assert by_host.text == "served from the sandbox"


def test_websocket_upgrade_is_bridged(sbx, server, tmp_path) -> None:
    s, ip = sbx
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    s.commands.run(f"{sys.executable} {script} {ip} 8765", background=True, user="root")
    headers = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8765"}
    deadline = time.monotonic() + 15
    while True:
        try:
            conn = ws_client.connect(server.url.replace("http", "ws") + "/",
                                     additional_headers=headers)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with conn:
        conn.send("ping")
        assert conn.recv(timeout=5) == "ping"
        conn.send(b"\x00\x01")
        assert conn.recv(timeout=5) == b"\x00\x01"


def test_closed_port_gets_the_port_is_not_open_502(sbx, server) -> None:
    s, _ = sbx
    r = httpx.get(server.url + "/", headers={"E2b-Sandbox-Id": s.sandbox_id,
                                             "E2b-Sandbox-Port": "9"})
    assert r.status_code == 502 and "port is not open" in r.json()["message"]


def test_one_routing_header_without_the_other_is_400(server) -> None:
    r = httpx.get(server.url + "/health", headers={"E2b-Sandbox-Id": "abc"})
    assert r.status_code == 400 and r.json()["code"] == 400


def test_private_sandbox_ports_need_the_traffic_token(api_env, server, tmp_path) -> None:
    s = Sandbox.create("base", network={"allow_public_traffic": False})
    try:
        token = s.traffic_access_token
        assert token
        ip = server.server.sandboxes.get(s.sandbox_id).host_ip
        (tmp_path / "p.txt").write_text("private")
        s.commands.run(f"cd {tmp_path} && {sys.executable} -m http.server 8124 --bind {ip}",
                       background=True, user="root")
        headers = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8124"}
        ok = _wait_port(server.url + "/p.txt",
                        {**headers, "E2B-Traffic-Access-Token": token})
        assert ok.status_code == 200 and ok.text == "private"
        assert httpx.get(server.url + "/p.txt", headers=headers).status_code == 403
        wrong = {**headers, "E2B-Traffic-Access-Token": "x" * 40}
        assert httpx.get(server.url + "/p.txt", headers=wrong).status_code == 403
        assert s.commands.run("echo envd-needs-no-traffic-token").exit_code == 0
    finally:
        s.kill()
