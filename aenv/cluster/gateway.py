"""``aenv gateway``: one URL for many nodes. Stateless; every answer comes from Redis and
the nodes, so any number of gateways can serve side by side.

One listener, as a node has (``aenv.proxy.front.Front`` decides per request):

- sandbox traffic (``E2b-Sandbox-Id``/``-Port`` headers, or Host ``<port>-<id>.<domain>``)
  is streamed by ``aenv.proxy.ProxyRouter`` (HTTP and WebSocket, the node's own code) to
  the node that holds the sandbox, per the Redis index; the node routes it on to the VM
  (the hop is ``aenv.proxy.relay``'s). Sandboxes unknown to the index, or on a node past
  its heartbeat TTL, answer E2B's 502 "The sandbox was not found", except a paused one
  created with ``autoResume`` whose node offered it to the cluster (shared store): the
  traffic resumes it on another node, as a connect would (below), and then goes there;
  concurrent requests wait for the one resume. A route found is reused for
  ``ROUTE_CACHE_S`` (5 s) unless its node stops answering or answers 502 (the sandbox is
  not there: killed, or moved by another gateway), which drops it at once.
  Signed ``/files`` URLs and token-only envd calls need the sandbox's token, which a
  gateway does not have: it asks the nodes whose they are (``owners``), then routes them.
- REST, after the client's ``X-API-KEY`` is checked against the gateway's key:
  ``POST /sandboxes`` (and ``/v2/sandboxes``) goes to the best node
  (``scheduling.candidates``: ready, with room in every lasting budget it publishes;
  nodes with a start free first, least full first, then nodes that queue it behind their
  starts, shortest queue first), then to the next one when a node answers 429 or 5xx or
  does not answer (a create that timed out may still finish on the slow node). When no
  ready node has room or a queue place by the published figures, the gateway answers 429
  with ``Retry-After`` itself.
  ``GET /sandboxes`` and ``GET /v2/sandboxes`` ask every live node and merge the answers,
  ordered as a node orders them (by ``startedAt``, then id; ``order`` as given). A v2
  page is the first ``limit`` of the merged pages (each node gives at most ``limit``
  after the cursor, so none of the first ``limit`` is missed); its ``x-next-token`` is
  the nodes' own cursor (``aenv.api.listing``: start time and id) of its last sandbox,
  which every node applies to its own list. Nodes that do not answer are left out and
  named in ``x-aenv-unreachable-nodes``. ``/sandboxes/{id}/...`` (and
  ``/v2/sandboxes/{id}/connect``) goes to the sandbox's node. ``GET /nodes`` and
  ``GET /nodes/{id}`` report the registry; ``POST /nodes/{id}`` with ``{"status":
  "ready"|"draining"}`` (E2B's admin call) drains a node or takes it back.
- Templates: a build request (``POST /v3/templates``) goes to a ready node with room,
  and the template's id and aliases are routed to that node from then on (Redis
  ``templates``): its files, build, status and tag calls go there (to the first node that
  knows it when that node is gone); a delete goes to every node. Template and snapshot
  lists merge every node's, without repeats; ``/snapshots/{id}``, aliases and tags go to
  the first node that knows them. A create prefers the nodes that hold its template
  (Redis ``template:<ref>:nodes``: where it was built or already started; not ``base``,
  which every node has), by ``scheduling.CACHE_PREFERENCE``. With a shared
  store (``AENV_SHARED_STORE``) any node starts a template built elsewhere.
- Volumes live on the node that made them (``volume_routes``): their REST and content
  calls (``/volumecontent``, before the key check: the volume's token) go there, and a
  create with ``volumeMounts`` goes to that node only; shared volumes (nodes with a shared
  store) are served by any node that has it, and their sandboxes go to any of those.
- Secrets (``/secrets``) are the cluster's, in Redis (``shared_secrets``): the gateway
  serves them itself, with a node's own routes and rules (``aenv.api.secrets``).
  Anything else answers 501.
- A resume or connect of a paused sandbox whose node is gone (past its TTL, or not
  answering) or full (429) goes to another ready node with a start free that can restore its
  snapshot (``NodeRecord.restores`` against the requirements the node published with it,
  ``handover``); the first that resumes it owns it. None can: 409 naming why per node.

Calls to nodes carry ``X-Aenv-Cluster-Secret`` (``trust``) in place of the client's key.
Advertised node URLs must be ``http://`` in this slice.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from ..api.auth import ApiKeyMiddleware
from ..api.errors import ApiError
from ..api.listing import DEFAULT_LIMIT, decode_cursor
from ..client.http import plain_client
from ..orchestrator.template_records import BASE_TEMPLATE
from ..proxy import ProxyRouter, Route, RouteTable
from ..proxy.front import Front
from ..storage.shared_store import incompatibilities
from .owners import Owners
from .registry import NodeStatus, Registry
from .scheduling import RETRY_AFTER_S, Ask, candidates
from .shared_secrets import SharedSecrets, secrets_app
from .trust import SECRET_HEADER
from .volume_routes import SHARED, VolumeRoutes, content_first, is_volume_call

log = logging.getLogger("aenv.gateway")

MAX_BODY_BYTES = 1024 * 1024
CONNECT_TIMEOUT_S = 2.0
CREATE_TIMEOUT_S = 120.0     # a create on a busy TCG node can take long; then the next node
CALL_TIMEOUT_S = 300.0       # pause/fork/connect may take a while under TCG
LIST_TIMEOUT_S = 10.0
# Sandbox traffic reuses a route this long before asking Redis again (two round trips);
# the relay drops it sooner when the node does not answer or answers 502 (``on_stale``).
ROUTE_CACHE_S = 5.0
ROUTE_CACHE_SIZE = 100_000
# What a resume by traffic asks for (the node's own auto-resume gives the same).
AUTO_RESUME_TIMEOUT_S = 300
_SANDBOX = re.compile(r"^(?:/v2)?/sandboxes/([^/]+)(?:/.*)?$")
_TEMPLATE = re.compile(r"^(?:/v2)?/templates/(?!aliases/|tags/?$)([^/]+)(?:/.*)?$")
_UPLOAD = re.compile(r"^/templates/([^/]+)/files/[^/]+/upload$")
_FILES = re.compile(r"^/templates/[^/]+/files/[^/]+$")
_TEMPLATE_LISTS = {"/templates": "templateID", "/v2/templates": "templateID",
                   "/snapshots": "snapshotID"}
_RESUMES = re.compile(r"^(?:/v2)?/sandboxes/[^/]+/(?:resume|connect)/?$")
_CREATES = ("/sandboxes", "/v2/sandboxes")
_NODE = re.compile(r"^/nodes/([^/]+)/?$")
_LISTS = ("/sandboxes", "/v2/sandboxes")
_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
        b"x-api-key", SECRET_HEADER}
_OUT_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"upgrade",
            b"content-length"}

Headers = list[tuple[bytes, bytes]]


class Reply:
    """A whole response: status, headers, body."""

    def __init__(self, status: int, headers: Headers, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    @classmethod
    def json(cls, status: int, value: Any, extra: Headers | None = None) -> Reply:
        body = json.dumps(value).encode()
        return cls(status, [(b"content-type", b"application/json"), *(extra or [])], body)

    @classmethod
    def error(cls, status: int, message: str) -> Reply:
        return cls.json(status, {"code": status, "message": message})

    async def __call__(self, send: Send) -> None:
        headers = [*self.headers, (b"content-length", str(len(self.body)).encode())]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


def node_view(n: NodeStatus) -> dict[str, Any]:
    """One node as ``GET /nodes`` shows it."""
    r = n.record
    return {"nodeID": r.node_id, "url": r.url, "status": n.status, "version": r.version,
            "sandboxes": {"running": r.running, "paused": r.paused, "starting": r.starting,
                          "queued": r.queued},
            "capacity": {"maxSandboxes": r.max_sandboxes, "maxStarting": r.max_starting,
                         "startQueue": r.start_queue, "cpuCount": r.vcpus,
                         "memoryMB": r.memory_mb},
            "usage": {"cpuCount": r.vcpus_used, "memoryMB": r.memory_used_mb},
            "publishedAt": r.published_at}


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)


class Gateway:
    def __init__(self, registry: Registry, *, api_key: str, cluster_secret: str) -> None:
        self.registry = registry
        self.secret = cluster_secret.encode()
        self.http = plain_client(timeout=httpx.Timeout(CALL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                                 limits=httpx.Limits(max_connections=512,
                                                     max_keepalive_connections=64),
                                 follow_redirects=False)
        self.in_flight: Counter[str] = Counter()   # creates this gateway has sent, per node
        self.proxy = ProxyRouter(RouteTable(self._route))
        self.proxy.on_stale = self._forget_route
        self._routes: dict[str, tuple[float, Route]] = {}  # sandbox id -> (until, route)
        self._resuming: dict[str, asyncio.Task[bool]] = {}  # by traffic, per sandbox id
        self.volumes = VolumeRoutes(self)
        self.secrets_api = secrets_app(
            SharedSecrets(registry.client, cluster_secret, prefix=registry.prefix))
        # The volume content API has its own auth (the volume's token), which its node checks.
        rest = content_first(ApiKeyMiddleware(self._rest, api_key), self.volumes)
        # Signed /files URLs and token-only envd calls name no sandbox: the nodes say whose.
        self.owners = Owners(registry, self.http, self.secret)
        self.app: ASGIApp = _Lifespan(
            Front(rest, self.proxy, self.owners.signed, self.owners.token), self.close)

    async def close(self) -> None:
        for task in list(self._resuming.values()):
            task.cancel()
        await self.proxy.close()
        await self.http.aclose()
        await self.registry.close()

    # -- data plane

    async def _route(self, sandbox_id: str) -> Route | None:
        now = time.monotonic()
        cached = self._routes.get(sandbox_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        route = await self._lookup(sandbox_id)
        if route is None and await self._resumed_by_traffic(sandbox_id):
            route = await self._lookup(sandbox_id)
        if route is not None:  # misses are not kept: a new sandbox is routed at once
            if len(self._routes) >= ROUTE_CACHE_SIZE:
                self._routes = {k: v for k, v in self._routes.items() if v[0] > now}
                if len(self._routes) >= ROUTE_CACHE_SIZE:
                    self._routes.clear()
            self._routes[sandbox_id] = (now + ROUTE_CACHE_S, route)
        return route

    def _forget_route(self, sandbox_id: str) -> None:
        self._routes.pop(sandbox_id, None)

    async def _lookup(self, sandbox_id: str) -> Route | None:
        try:
            owner = await self.registry.locate(sandbox_id)
            node = await self.registry.node(owner) if owner else None
        except (RedisError, OSError) as e:
            log.warning("registry unreachable routing sandbox %s: %s", sandbox_id, e)
            return None
        if node is None or not node.alive:
            return None
        host, port = _address(node.record.url)
        return Route(sandbox_id=sandbox_id, host_ip=host, envd_token=None, traffic_token=None,
                     generation=f"{node.record.node_id}@{node.record.url}", node=(host, port))

    async def _resumed_by_traffic(self, sandbox_id: str) -> bool:
        """Traffic for a paused ``autoResume`` sandbox whose node is gone: resume it on
        another node (one resume however many requests wait); True once it runs there."""
        task = self._resuming.get(sandbox_id)
        if task is None:
            try:
                owner = await self.registry.locate(sandbox_id)
                node = await self.registry.node(owner) if owner else None
                if node is None or node.alive:  # a live node resumes its own
                    return False
                if not await self.registry.auto_resumes(sandbox_id):
                    return False
            except (RedisError, OSError) as e:
                log.warning("registry unreachable routing sandbox %s: %s", sandbox_id, e)
                return False
            task = self._resuming.get(sandbox_id)  # another request's, started meanwhile
            if task is None:
                task = asyncio.create_task(self._resume_gone(sandbox_id, node),
                                           name=f"auto-resume-{sandbox_id}")
                self._resuming[sandbox_id] = task
                task.add_done_callback(lambda _: self._resuming.pop(sandbox_id, None))
        return await asyncio.shield(task)

    async def _resume_gone(self, sandbox_id: str, owner: NodeStatus) -> bool:
        log.info("sandbox %s: traffic while paused on node %s, which is gone: resuming it "
                 "elsewhere", sandbox_id, owner.record.node_id)
        path = f"/sandboxes/{sandbox_id}/connect"
        scope: Scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
                        "headers": [(b"content-type", b"application/json")]}
        body = json.dumps({"timeout": AUTO_RESUME_TIMEOUT_S}).encode()
        try:
            reply = await self._resume_elsewhere(scope, body, sandbox_id, owner, None)
        except (RedisError, OSError) as e:
            log.warning("sandbox %s: not resumed by traffic: %s", sandbox_id, e)
            return False
        if reply.status >= 300:
            log.warning("sandbox %s: not resumed by traffic (%d): %s", sandbox_id,
                        reply.status, reply.body[:300].decode("utf-8", "replace"))
            return False
        return True

    # -- REST

    async def _rest(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/secrets" or scope["path"].startswith("/secrets/"):
            return await self.secrets_api(scope, receive, send)
        try:
            reply = await self._answer(scope, receive)
        except (RedisError, OSError) as e:
            log.warning("registry unreachable: %s", e)
            reply = Reply.error(503, "the cluster's registry (Redis) is unreachable")
        await reply(send)

    async def _answer(self, scope: Scope, receive: Receive) -> Reply:
        method, path = scope["method"], scope["path"]
        if path == "/health":
            return Reply(204, [], b"")
        if path == "/nodes" and method == "GET":
            return Reply.json(200, [node_view(n) for n in await self.registry.nodes()])
        if (m := _NODE.match(path)) and method == "GET":
            node = await self.registry.node(m.group(1))
            if node is None:
                return Reply.error(404, f"node '{m.group(1)}' not found")
            return Reply.json(200, node_view(node))
        if (m := _NODE.match(path)) and method == "POST":
            body = await _body(receive)
            return await self._set_status(m.group(1), body or b"")
        if method == "PUT" and (m := _UPLOAD.match(path)):
            return await self._upload(scope, receive, m.group(1))
        body = await _body(receive)
        if body is None:
            return Reply.error(413, "request body too large")
        if path in _CREATES and method == "POST":
            return await self._create(scope, body)
        if is_volume_call(path):
            return await self.volumes.rest(scope, body)
        if path in _LISTS and method == "GET":
            return await self._list(scope)
        if m := _SANDBOX.match(path):
            reply = await self._to_owner(scope, body, m.group(1))
            await self.volumes.after_sandbox_call(scope, reply, m.group(1))
            return reply
        if path == "/v3/templates" and method == "POST":
            return await self._build(scope, body)
        if path in _TEMPLATE_LISTS and method == "GET":
            return await self._merged(scope, _TEMPLATE_LISTS[path])
        if m := _TEMPLATE.match(path):
            return await self._to_template(scope, body, m.group(1))
        if path.startswith(("/snapshots/", "/templates/aliases/", "/templates/tags")):
            return await self._first_found(scope, body, None)
        return Reply.error(501, f"{method} {path} is not served through the gateway yet")

    def _request(self, node: NodeStatus, scope: Scope, body: bytes,
                 query: bytes | None = None) -> httpx.Request:
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP]
        headers.append((SECRET_HEADER, self.secret))
        qs = scope.get("query_string", b"") if query is None else query
        url = httpx.URL(node.record.url + scope["path"], query=qs or None)
        return self.http.build_request(scope["method"], url, headers=headers,
                                       content=body or None)

    async def _call(self, request: httpx.Request, timeout: float) -> Reply:
        request.extensions["timeout"] = httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S).as_dict()
        response = await self.http.send(request, stream=True)
        try:
            body = b"".join([chunk async for chunk in response.aiter_raw()])
        finally:
            await response.aclose()
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _OUT_HOP]
        return Reply(response.status_code, headers, body)

    async def _create(self, scope: Scope, body: bytes) -> Reply:
        template = _field(body, "templateID")
        if template == BASE_TEMPLATE:  # every node has its own
            template = None
        holders = await self.registry.template_nodes(template) if template else set()
        nodes = await self.registry.nodes()
        order = candidates(nodes, self.in_flight, holders, Ask.of(body))
        mounts_on = await self.volumes.mounts_node(body)
        if isinstance(mounts_on, Reply):
            return mounts_on
        if mounts_on == SHARED:  # shared volumes: any node that serves them
            order = [n for n in order if n.record.shared_volumes]
            if not any(n.record.shared_volumes and n.status == "ready" for n in nodes):
                return Reply.error(503, "no node that serves shared volumes is ready")
        elif mounts_on is not None:  # where its volumes live; that node's admission decides
            order = [n for n in nodes if n.record.node_id == mounts_on and n.status == "ready"]
            if not order:
                return Reply.error(503, f"the node of the sandbox's volumes ({mounts_on}) is "
                                   "not ready (gone or draining)")
        if not order:
            if any(n.status == "ready" for n in nodes):
                return Reply.json(
                    429, {"code": 429, "message": "every node of the cluster is full (sandboxes, "
                          "vCPUs, memory or its start queue); try again later"},
                    [(b"retry-after", str(RETRY_AFTER_S).encode())])
            return Reply.error(503, "no node of the cluster is ready for a sandbox")
        last: Reply | None = None
        for node in order:
            nid = node.record.node_id
            self.in_flight[nid] += 1
            try:
                reply = await self._call(self._request(node, scope, body), CREATE_TIMEOUT_S)
            except httpx.HTTPError as e:
                log.warning("create on node %s failed (%s: %s); trying the next", nid,
                            type(e).__name__, e)
                continue
            finally:
                self.in_flight[nid] -= 1
                if self.in_flight[nid] <= 0:
                    del self.in_flight[nid]
            if reply.status == 429 or reply.status >= 500:
                log.info("create refused by node %s (%d); trying the next", nid, reply.status)
                last = reply
                continue
            if reply.status < 300 and template and nid not in holders:
                await self.registry.add_template_node(template, nid)
            return reply
        return last or Reply.error(503, "no node of the cluster answered the create")

    async def _set_status(self, node_id: str, body: bytes) -> Reply:
        """E2B's ``POST /nodes/{id}`` ``{"status": "ready"|"draining"}``: the node's own
        ``/node/ready`` or ``/node/drain`` (``aenv.cluster.drain``)."""
        status = _field(body, "status")
        if status not in ("ready", "draining"):
            return Reply.error(400, 'body must be {"status": "ready"} or {"status": "draining"}')
        node = await self.registry.node(node_id)
        if node is None:
            return Reply.error(404, f"node '{node_id}' not found")
        if not node.alive:
            return Reply.error(409, f"node '{node_id}' is unhealthy (no heartbeat): its "
                               "status cannot change")
        path = "/node/ready" if status == "ready" else "/node/drain"
        request = self.http.build_request("POST", node.record.url + path,
                                          headers=[(SECRET_HEADER, self.secret)])
        try:
            reply = await self._call(request, LIST_TIMEOUT_S)
        except httpx.HTTPError as e:
            return Reply.error(502, f"node '{node_id}' did not answer: {e}")
        if reply.status >= 300:
            return reply
        return Reply.json(200, node_view(await self.registry.node(node_id) or node))

    # -- templates and snapshots

    async def _build(self, scope: Scope, body: bytes) -> Reply:
        """A build request goes to a ready node with room (the next one when it refuses);
        the template's id and aliases are then routed to that node, where its files,
        build and status calls must go."""
        last: Reply | None = None
        for node in candidates(await self.registry.nodes(), self.in_flight, queue=False):
            try:
                reply = await self._call(self._request(node, scope, body), CREATE_TIMEOUT_S)
            except httpx.HTTPError as e:
                log.warning("build request on node %s failed (%s); trying the next",
                            node.record.node_id, e)
                continue
            if reply.status == 429 or reply.status >= 500:
                last = reply
                continue
            if reply.status < 300:
                answer = json.loads(reply.body or b"{}")
                refs = [answer.get("templateID"), *(answer.get("aliases") or [])]
                await self.registry.set_template_home(
                    node.record.node_id, *[r for r in refs if isinstance(r, str) and r])
            return reply
        return last or Reply.error(503, "no node of the cluster is ready to build a template")

    async def _to_template(self, scope: Scope, body: bytes, ref: str) -> Reply:
        """Calls about one template: to the node that built it; a delete to every node
        (each may hold a copy taken from the shared store); otherwise, or when its node
        is gone, to the first node that knows it."""
        if scope["method"] == "DELETE":
            return await self._everywhere(scope, body)
        home = await self.registry.template_home(ref)
        node = await self.registry.node(home) if home else None
        if node is not None and node.alive:
            try:
                reply = await self._call(self._request(node, scope, body), CALL_TIMEOUT_S)
                return _through_gateway(reply, scope, node) if _FILES.match(scope["path"]) \
                    else reply
            except httpx.HTTPError as e:
                log.warning("node %s did not answer %s %s: %s", node.record.node_id,
                            scope["method"], scope["path"], e)
        return await self._first_found(scope, body, home)

    async def _upload(self, scope: Scope, receive: Receive, ref: str) -> Reply:
        """A build's COPY archive (signed URL, no API key): streamed to the template's
        node, which checks the token."""
        home = await self.registry.template_home(ref)
        node = await self.registry.node(home) if home else None
        if node is None or not node.alive:
            return Reply.error(404, f"template '{ref}' has no live node")

        async def chunks() -> AsyncIterator[bytes]:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                yield msg.get("body", b"")
                if not msg.get("more_body", False):
                    return

        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP]
        headers.append((SECRET_HEADER, self.secret))
        request = self.http.build_request(
            "PUT", httpx.URL(node.record.url + scope["path"],
                             query=scope.get("query_string") or None),
            headers=headers, content=chunks())
        try:
            return await self._call(request, CALL_TIMEOUT_S)
        except httpx.HTTPError as e:
            return Reply.error(502, f"the node of template '{ref}' did not answer: {e}")

    async def _first_found(self, scope: Scope, body: bytes, skip: str | None) -> Reply:
        """The first live node's answer that is not a 404 (or the last 404)."""
        last: Reply | None = None
        for node in await self.registry.nodes():
            if not node.alive or node.record.node_id == skip:
                continue
            try:
                reply = await self._call(self._request(node, scope, body), CALL_TIMEOUT_S)
            except httpx.HTTPError:
                continue
            if reply.status != 404:
                return reply
            last = reply
        return last or Reply.error(404, f"{scope['path']} not found on any node")

    async def _everywhere(self, scope: Scope, body: bytes) -> Reply:
        """Every live node's answer; the first success, else the first failure."""
        nodes = [n for n in await self.registry.nodes() if n.alive]

        async def one(node: NodeStatus) -> Reply | None:
            try:
                return await self._call(self._request(node, scope, body), CALL_TIMEOUT_S)
            except httpx.HTTPError:
                return None

        answers = [a for a in await asyncio.gather(*(one(n) for n in nodes)) if a]
        ok = [a for a in answers if a.status < 300]
        return (ok or answers or [Reply.error(503, "no node of the cluster answered")])[0]

    async def _merged(self, scope: Scope, key: str) -> Reply:
        """A template or snapshot list: every live node's, without repeats (a template
        taken from the shared store is listed by each node that holds it)."""
        nodes = [n for n in await self.registry.nodes() if n.alive]

        async def one(node: NodeStatus) -> Reply | None:
            try:
                return await self._call(self._request(node, scope, b""), LIST_TIMEOUT_S)
            except httpx.HTTPError:
                return None

        answers = await asyncio.gather(*(one(n) for n in nodes))
        seen: set[str] = set()
        merged: list[dict[str, Any]] = []
        failed = []
        for node, answer in zip(nodes, answers, strict=True):
            if answer is None or answer.status >= 500:
                failed.append(node.record.node_id)
                continue
            if answer.status != 200:
                return answer
            for item in json.loads(answer.body):
                if item.get(key) not in seen:
                    seen.add(item.get(key))
                    merged.append(item)
        extra: Headers = []
        if failed:
            extra.append((b"x-aenv-unreachable-nodes", ",".join(failed).encode()))
        return Reply.json(200, merged, extra)

    async def _list(self, scope: Scope) -> Reply:
        params = parse_qsl(scope.get("query_string", b"").decode("latin-1"),
                           keep_blank_values=True)
        given = dict(params)
        paged = scope["path"] == "/v2/sandboxes"
        after = None
        if paged and given.get("nextToken"):
            try:
                after = decode_cursor(given["nextToken"])
            except ApiError as e:
                return Reply.error(e.status, e.message)
        nodes = [n for n in await self.registry.nodes() if n.alive]

        async def one(node: NodeStatus) -> Reply | Exception:
            try:
                return await self._call(self._request(node, scope, b""), LIST_TIMEOUT_S)
            except httpx.HTTPError as e:
                return e

        answers = await asyncio.gather(*(one(n) for n in nodes))
        merged: list[dict[str, Any]] = []
        failed: list[str] = []
        more = False
        for node, answer in zip(nodes, answers, strict=True):
            if isinstance(answer, Exception) or answer.status >= 500:
                failed.append(node.record.node_id)
                continue
            if answer.status != 200:
                return answer  # a bad query: every node says the same
            merged.extend(json.loads(answer.body))
            more = more or any(k.lower() == b"x-next-token" for k, _ in answer.headers)
        if after is not None:  # the page's last sandbox, if a node's rounding kept it
            merged = [s for s in merged if s.get("sandboxID") != after[1]]
        merged.sort(key=lambda s: (s.get("startedAt") or "", s.get("sandboxID") or ""),
                    reverse=given.get("order", "desc") != "asc")
        extra: Headers = []
        if paged:
            limit = given.get("limit", "")
            cut = int(limit) if limit.isdigit() else DEFAULT_LIMIT
            more = more or len(merged) > cut
            merged = merged[:cut]
            if more and merged:
                extra.append((b"x-next-token", _cursor(merged[-1]).encode()))
        if failed:
            extra.append((b"x-aenv-unreachable-nodes", ",".join(failed).encode()))
        return Reply.json(200, merged, extra)

    async def _to_owner(self, scope: Scope, body: bytes, sandbox_id: str) -> Reply:
        owner = await self.registry.locate(sandbox_id)
        node = await self.registry.node(owner) if owner else None
        if node is None:
            return Reply.error(404, f"sandbox '{sandbox_id}' not found")
        resumes = scope["method"] == "POST" and bool(_RESUMES.match(scope["path"]))
        if not node.alive:
            if resumes:
                return await self._resume_elsewhere(scope, body, sandbox_id, node, None)
            return Reply.error(503, f"the node of sandbox '{sandbox_id}' ({node.record.node_id})"
                               " is unreachable")
        try:
            reply = await self._call(self._request(node, scope, body), CALL_TIMEOUT_S)
        except httpx.HTTPError as e:
            log.warning("node %s did not answer %s %s: %s", node.record.node_id,
                        scope["method"], scope["path"], e)
            if resumes:
                return await self._resume_elsewhere(scope, body, sandbox_id, node, None)
            return Reply.error(502, f"the node of sandbox '{sandbox_id}' did not answer")
        if resumes and reply.status == 429:  # full: another node may take it over
            return await self._resume_elsewhere(scope, body, sandbox_id, node, reply)
        return reply

    async def _resume_elsewhere(self, scope: Scope, body: bytes, sandbox_id: str,
                                owner: NodeStatus, refused: Reply | None) -> Reply:
        """Resume a paused sandbox on another node, when its node offered it to the cluster
        (shared store, ``handover``) and its own node is gone or full: the ready nodes with
        room that can restore its snapshot, best first; the first that resumes it owns it.
        """
        requires = await self.registry.requires(sandbox_id)
        gone = refused is None
        if requires is None:
            return refused or Reply.error(
                503, f"the node of sandbox '{sandbox_id}' ({owner.record.node_id}) is "
                "unreachable, and the sandbox is not paused in the shared store")
        others = [n for n in candidates(await self.registry.nodes(), self.in_flight, queue=False)
                  if n.record.node_id != owner.record.node_id]
        checked = {k: v for k, v in requires.items() if k != "kernel"}  # the node checks it
        able, unable = [], []
        for n in others:
            why = incompatibilities(checked, n.record.restores)
            if why:
                unable.append(f"node {n.record.node_id}: {'; '.join(why)}")
            else:
                able.append(n)
        last = refused
        for node in able:
            try:
                reply = await self._call(self._request(node, scope, body), CALL_TIMEOUT_S)
            except httpx.HTTPError as e:
                log.warning("resume of %s on node %s failed (%s); trying the next",
                            sandbox_id, node.record.node_id, e)
                continue
            if reply.status < 300:
                log.info("sandbox %s: resumed on node %s (its node %s is %s)", sandbox_id,
                         node.record.node_id, owner.record.node_id,
                         "gone" if gone else "full")
                self._routes.pop(sandbox_id, None)
                return reply
            log.info("resume of %s refused by node %s (%d); trying the next", sandbox_id,
                     node.record.node_id, reply.status)
            last = reply
            if reply.status == 409:
                unable.append(f"node {node.record.node_id}: "
                              f"{json.loads(reply.body or b'{}').get('message', '')}")
        if last is not None and last.status != 409:
            return last
        where = "; ".join(unable) if unable else "no other node is ready with room"
        return Reply.error(409 if unable else 503,
                           f"sandbox '{sandbox_id}' is paused on node {owner.record.node_id}, "
                           f"which is {'gone' if gone else 'full'}, and no node can resume "
                           f"it: {where}")


def _through_gateway(reply: Reply, scope: Scope, node: NodeStatus) -> Reply:
    """A file-upload link the node made with its own address, made the gateway's (the
    Host the client used), where the upload is streamed on to the node."""
    try:
        answer = json.loads(reply.body)
    except ValueError:
        return reply
    url = answer.get("url") if isinstance(answer, dict) else None
    host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
    if not isinstance(url, str) or not url.startswith(node.record.url) or not host:
        return reply
    scheme = scope.get("scheme", "http")
    answer["url"] = f"{scheme}://{host}{url[len(node.record.url):]}"
    headers = [(k, v) for k, v in reply.headers if k.lower() != b"content-type"]
    return Reply.json(reply.status, answer, headers)


def _field(body: bytes, name: str) -> str | None:
    """A string field of a JSON request body, if there is one."""
    try:
        value = json.loads(body).get(name) if body else None
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def _cursor(listed: dict[str, Any]) -> str:
    """The node's next-page token (``aenv.api.listing``'s cursor) after ``listed``, a
    sandbox as a list shows it: every node understands it, and it orders across nodes."""
    started = datetime.fromisoformat(str(listed["startedAt"]).replace("Z", "+00:00"))
    key = [started.timestamp(), listed["sandboxID"]]
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode()


async def _body(receive: Receive) -> bytes | None:
    """The request's whole body, or None past ``MAX_BODY_BYTES``."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not msg.get("more_body", False):
            break
    return b"".join(chunks)


class _Lifespan:
    """Answers ASGI lifespan events (closing the gateway at shutdown), passes the rest."""

    def __init__(self, app: ASGIApp, close: Callable[[], Awaitable[None]]) -> None:
        self.app, self.close = app, close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
