"""With TLS on 443 and wildcard DNS the E2B SDK needs only ``E2B_DOMAIN``: REST goes to
``https://api.<domain>``, envd to ``https://49983-<id>.<domain>``, and ``get_host(port)``
is ``<port>-<id>.<domain>``, all with no port in the Host header. This pins how the
shared listener routes those hosts."""

from __future__ import annotations

import asyncio

import pytest

from aenv.proxy.front import Front

DOMAIN = "aenv.test"


def _route(host: str, path: str = "/", **headers: str) -> tuple[str, object]:
    """Where ``Front`` sends a request: ("api", path) or ("sandbox", (id, port))."""
    seen: list[tuple[str, object]] = []

    async def api(scope, receive, send) -> None:
        seen.append(("api", scope["path"]))

    async def proxy(scope, receive, send, sandbox_id: str, port: int) -> None:
        seen.append(("sandbox", (sandbox_id, port)))

    async def nobody(*_: object) -> None:
        return None

    async def send(_: dict) -> None:
        pass

    raw = [(b"host", host.encode())] + [
        (k.replace("_", "-").lower().encode(), v.encode()) for k, v in headers.items()]
    scope = {"type": "http", "method": "GET", "path": path, "query_string": b"",
             "headers": raw}
    asyncio.run(Front(api, proxy, nobody, nobody)(scope, None, send))
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("host", [f"8080-abc123.{DOMAIN}", f"8080-abc123.{DOMAIN}:443",
                                  f"8080-ABC123.{DOMAIN.upper()}"])
def test_get_host_without_a_port_reaches_the_sandbox_port(host: str) -> None:
    assert _route(host) == ("sandbox", ("abc123", 8080))


def test_envd_host_reaches_envd_even_with_routing_headers() -> None:
    assert _route(f"49983-abc123.{DOMAIN}", "/process.Process/Start",
                  E2b_Sandbox_Id="abc123", E2b_Sandbox_Port="49983") == \
        ("sandbox", ("abc123", 49983))


@pytest.mark.parametrize("path", ["/v2/sandboxes", "/sandboxes/abc123/connect", "/health"])
def test_api_host_reaches_the_rest_api(path: str) -> None:
    assert _route(f"api.{DOMAIN}", path, X_API_KEY="e2b_" + "0" * 40) == ("api", path)
    assert _route(f"api.{DOMAIN}", path) == ("api", path)
