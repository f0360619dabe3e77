"""One listener for both the REST API and sandbox traffic (``E2B_API_URL`` may equal
``E2B_SANDBOX_URL``): decide per request which one it is.

Sandbox traffic is recognised by a Host of ``<port>-<id>.<domain>``, by the
``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` header pair (both or neither), or — for the SDK's
signed ``download_url``/``upload_url``, which carry no routing headers — by a ``/files``
request with a ``signature`` that one running sandbox's token reproduces.

A request with ``X-API-KEY`` (or a gateway's ``X-Aenv-Cluster-Secret``, see
``aenv.cluster.trust``) is an API call even when it has the routing headers: SDKs from 2.7
to about 2.50 send them on ``POST /sandboxes/{id}/connect`` too, and the SDK never sends the API
key to envd.

Last resort: an envd request (RPC or ``/files``) with no routing at all but an
``X-Access-Token`` goes to the running sandbox that owns that token. E2B 2.7's sync
``Sandbox.connect`` builds its envd client without the routing headers, so this is the only
way its calls can arrive.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from ..envd import ENVD_PORT
from ..envd.signing import Operation
from .router import ProxyRouter, _answer, _json, not_found, parse_host

SignedLookup = Callable[[str, Operation, str | None, str, str | None], Awaitable[str | None]]
TokenLookup = Callable[[str], Awaitable[str | None]]
_ENVD_RPC = ("/process.Process/", "/filesystem.Filesystem/")


class Front:
    def __init__(self, api: ASGIApp, proxy: ProxyRouter, signed_lookup: SignedLookup,
                 token_lookup: TokenLookup) -> None:
        self.api, self.proxy = api, proxy
        self.signed_lookup, self.token_lookup = signed_lookup, token_lookup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.api(scope, receive, send)
        headers = dict(scope["headers"])
        # A gateway's REST calls to a node carry the cluster secret instead (aenv/cluster).
        api_call = b"x-api-key" in headers or b"x-aenv-cluster-secret" in headers
        target = parse_host(headers.get(b"host", b"").decode("latin-1"))
        if target is None and not api_call:
            sid = headers.get(b"e2b-sandbox-id")
            port = headers.get(b"e2b-sandbox-port")
            if sid is not None or port is not None:
                if sid is None or port is None or not port.isdigit():
                    if scope["type"] == "websocket":
                        return await send({"type": "websocket.close", "code": 1008})
                    return await _answer(send, *_json(400, {
                        "code": 400,
                        "message": "E2b-Sandbox-Id and E2b-Sandbox-Port must be sent together"}))
                target = (int(port), sid.decode("latin-1"))
        if target is None and scope["type"] == "http" and scope["path"] == "/files":
            q = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            if "signature" in q:
                op: Operation = "read" if scope["method"] == "GET" else "write"
                sid = await self.signed_lookup(
                    q.get("path", [""])[0], op, q.get("username", [None])[0],
                    q["signature"][0], q.get("signature_expiration", [None])[0])
                if sid is None:
                    return await _answer(send, *not_found(""))
                target = (ENVD_PORT, sid)
        token = headers.get(b"x-access-token")
        if (target is None and token and scope["type"] == "http" and not api_call
                and (scope["path"] == "/files" or scope["path"].startswith(_ENVD_RPC))):
            sid = await self.token_lookup(token.decode("latin-1"))
            if sid is None:
                return await _answer(send, *not_found(""))
            target = (ENVD_PORT, sid)
        if target is None:
            return await self.api(scope, receive, send)
        port, sandbox_id = target
        await self.proxy(scope, receive, send, sandbox_id, port)
