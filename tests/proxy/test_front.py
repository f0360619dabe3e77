"""Which requests on the shared listener go to the API and which to a sandbox."""

from __future__ import annotations

import asyncio

from aenv.proxy.front import Front


class _Recorder:
    def __init__(self) -> None:
        self.api: list[str] = []
        self.proxied: list[tuple[str, int]] = []

    async def api_app(self, scope, receive, send) -> None:
        self.api.append(scope["path"])

    async def proxy(self, scope, receive, send, sandbox_id: str, port: int) -> None:
        self.proxied.append((sandbox_id, port))


async def _signed(*_: object) -> str | None:
    return None


async def _by_token(token: str) -> str | None:
    return {"tok-a": "sbxa"}.get(token)


def _call(rec: _Recorder, path: str, headers: dict[str, str]) -> list[dict]:
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(Front(rec.api_app, rec.proxy, _signed, _by_token)(scope, None, send))
    return sent


def test_routing_headers_send_envd_traffic_to_the_sandbox() -> None:
    rec = _Recorder()
    _call(rec, "/process.Process/Start", {"E2b-Sandbox-Id": "sbxa", "E2b-Sandbox-Port": "49983"})
    assert rec.proxied == [("sbxa", 49983)] and rec.api == []


def test_an_api_key_makes_it_an_api_call_despite_routing_headers() -> None:
    rec = _Recorder()
    _call(rec, "/sandboxes/sbxa/connect",
          {"X-API-KEY": "e2b_x", "E2b-Sandbox-Id": "sbxa", "E2b-Sandbox-Port": "49983"})
    assert rec.api == ["/sandboxes/sbxa/connect"] and rec.proxied == []


def test_unrouted_envd_call_goes_to_the_owner_of_its_access_token() -> None:
    rec = _Recorder()
    _call(rec, "/filesystem.Filesystem/Stat", {"X-Access-Token": "tok-a"})
    assert rec.proxied == [("sbxa", 49983)]
    sent = _call(rec, "/process.Process/Start", {"X-Access-Token": "nobody's"})
    assert sent[0]["status"] == 502 and rec.proxied == [("sbxa", 49983)]


def test_api_paths_with_an_access_token_stay_with_the_api() -> None:
    rec = _Recorder()
    _call(rec, "/v2/sandboxes", {"X-Access-Token": "tok-a"})
    assert rec.api == ["/v2/sandboxes"] and rec.proxied == []
