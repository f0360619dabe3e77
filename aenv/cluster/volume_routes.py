"""The gateway's volume calls: a node-local volume's go to its node; a shared one's to any.

**Shared volumes.** A node with a shared store keeps its volumes there
(``aenv.storage.shared_volumes``) and says so in its record (``shared_volumes``) instead of
publishing them: every such node serves every shared volume. A volume id or name that no
node published is taken for a shared one when a node of the cluster serves them:

- ``POST /volumes`` goes to a ready shared-volume node when there is one (names are unique
  through the shared store itself; the Redis claim below still holds while it runs);
- ``GET``/``DELETE /volumes/{id}`` and ``/volumecontent/{id}/...`` go to a live shared-volume
  node, ready ones first in random order, the next one when a node refuses the connection
  (503 when none is alive; the node answers 404/401 for an id it does not hold);
- a sandbox create that mounts only such volumes goes to the best ready node among those
  that serve them (``SHARED``), not to one node: sandboxes on every node mount the volume.

Node-local volumes (nodes without a shared store) keep the rules below.

A node-local volume is an image on the node that made it (``aenv.storage.volumes``),
served to that node's sandboxes only.
Each node publishes its volumes (``Registry.volume_node``,
``volume_name_node``), before its answer to a volume's create or delete goes out, so:

- ``POST /volumes``: the name is claimed in Redis for the time of the create
  (``Registry.claim_volume_name``), and refused with 409 when a node already holds a
  volume of that name (names are unique in the cluster, as in one E2B team); then the
  create goes to a ready node, best first by ``scheduling.candidates``, the next one only
  when a node refuses the connection or answers 429/503 (a create that timed out may have
  made the volume: it is not sent elsewhere). The answer is the node's.
- ``GET /volumes``: every live node's list, merged (``x-aenv-unreachable-nodes`` names
  those that did not answer).
- ``GET``/``DELETE /volumes/{id}``: to its node; 404 when no node published it; 503 when
  its node is gone (the volume is there, unreachable).
- ``/volumecontent/{id}/...`` (the SDKs' ``E2B_VOLUME_API_URL``): streamed both ways to its
  node, before the gateway's API-key check (these calls carry the volume's own bearer
  token, which the node checks); no body limit here, the volume's size bounds uploads
  there. A volume no node published answers 401, as a node answers an unknown one. Error
  bodies carry a string ``code``, as the content API's do.
- A sandbox create with ``volumeMounts`` (names) goes to the node of its volumes, whose own
  admission decides (``mounts_node``): 400 for a name no node holds (what a node answers)
  or volumes of two nodes, which no sandbox can mount together.
- A persistent snapshot of a sandbox that mounts node-local volumes (``POST
  /sandboxes/{id}/snapshots`` through a gateway) makes sandboxes that mount them too,
  which only that node can serve: its id and names are pinned there
  (``Registry.pin_to_volumes``, ``after_sandbox_call``), and a create from it goes there
  as a create with those mounts. One of a shared-volume node is not pinned: the node
  keeps its mounts in the shared store with the snapshot (``put_snapshot_mounts``), and
  any node that takes the snapshot mounts them.
"""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
from redis.exceptions import RedisError
from starlette.types import Receive, Scope, Send

from .registry import NodeStatus
from .scheduling import candidates

if TYPE_CHECKING:
    from .gateway import Gateway, Reply

CONTENT_PREFIX = "/volumecontent/"
# ``mounts_node``: the create's volumes are shared ones; any node that serves them will do.
SHARED = "*shared*"
# The SDKs give a volume's file calls an hour; a stream's bytes may pause that long too.
CONTENT_TIMEOUT_S = 3600.0
CREATE_TIMEOUT_S = 120.0
# A download is passed on in pieces of this size (not the transport's 64 KiB reads).
CHUNK = 1024 * 1024
_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"x-api-key",
        b"x-aenv-cluster-secret"}
_OUT_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"upgrade"}


def is_volume_call(path: str) -> bool:
    return path == "/volumes" or path.startswith("/volumes/")


def _names(body: bytes) -> list[str]:
    """The volume names of a create's ``volumeMounts`` (the node validates the rest)."""
    try:
        mounts = json.loads(body).get("volumeMounts") if body else None
    except (ValueError, AttributeError):
        return []
    if not isinstance(mounts, list):
        return []
    return sorted({m["name"] for m in mounts
                   if isinstance(m, dict) and isinstance(m.get("name"), str)})


class VolumeRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.registry = gateway.registry

    async def _node(self, volume_id: str) -> NodeStatus | None:
        home = await self.registry.volume_node(volume_id)
        return await self.registry.node(home) if home else None

    async def _shared_nodes(self) -> tuple[list[NodeStatus], bool]:
        """The live nodes that serve shared volumes, ready ones first (each group in random
        order, to spread the calls), and whether any such node is registered at all."""
        nodes = [n for n in await self.registry.nodes() if n.record.shared_volumes]
        ready = [n for n in nodes if n.status == "ready"]
        rest = [n for n in nodes if n.alive and n.status != "ready"]
        random.shuffle(ready)
        return ready + rest, bool(nodes)

    async def _to_shared(self, scope: Scope, body: bytes, volume_id: str) -> Reply:
        from .gateway import CALL_TIMEOUT_S, Reply

        nodes, any_shared = await self._shared_nodes()
        for node in nodes:
            try:
                return await self.gw._call(self.gw._request(node, scope, body), CALL_TIMEOUT_S)
            except httpx.ConnectError:
                continue
            except httpx.HTTPError as e:
                return Reply.error(502, f"node {node.record.node_id} did not answer about "
                                   f"volume {volume_id}: {e}")
        if any_shared:
            return Reply.error(503, "no node that serves shared volumes is reachable")
        return Reply.error(404, f"Volume {volume_id} not found")

    # -- REST

    async def rest(self, scope: Scope, body: bytes) -> Reply:
        from .gateway import CALL_TIMEOUT_S, Reply

        method, path = scope["method"], scope["path"]
        if path.rstrip("/") == "/volumes":
            if method == "POST":
                return await self._create(scope, body)
            if method == "GET":
                return await self.gw._merged(scope, "volumeID")
            return Reply.error(405, f"{method} is not allowed on /volumes")
        volume_id = path[len("/volumes/"):].strip("/")
        node = await self._node(volume_id)
        if node is None:
            return await self._to_shared(scope, body, volume_id)
        if not node.alive:
            return Reply.error(503, f"the node of volume {volume_id} ({node.record.node_id}) "
                               "is unreachable")
        try:
            return await self.gw._call(self.gw._request(node, scope, body), CALL_TIMEOUT_S)
        except httpx.HTTPError as e:
            return Reply.error(502, f"the node of volume {volume_id} did not answer: {e}")

    async def _create(self, scope: Scope, body: bytes) -> Reply:
        from .gateway import Reply, _field

        name = _field(body, "name")
        token = secrets.token_hex(8)
        if name is not None:
            if await self.registry.volume_name_node(name) is not None:
                return Reply.error(409, f"a volume named '{name}' already exists")
            if not await self.registry.claim_volume_name(name, token, CREATE_TIMEOUT_S + 10):
                return Reply.error(409, f"a volume named '{name}' is being created")
        try:
            nodes = await self.registry.nodes()
            if any(n.record.shared_volumes and n.status == "ready" for n in nodes):
                nodes = [n for n in nodes if n.record.shared_volumes]
            order = candidates(nodes, self.gw.in_flight, queue=True) or \
                [n for n in nodes if n.status == "ready"]
            last: Reply | None = None
            for node in order:
                request = self.gw._request(node, scope, body)
                try:
                    reply = await self.gw._call(request, CREATE_TIMEOUT_S)
                except httpx.ConnectError:
                    continue  # never reached the node: nothing was made there
                except httpx.HTTPError as e:
                    return Reply.error(502, f"node {node.record.node_id} did not answer the "
                                       f"volume create: {e}")
                if reply.status in (429, 503):
                    last = reply
                    continue
                return reply
            return last or Reply.error(503, "no node of the cluster is ready for a volume")
        finally:
            if name is not None:
                await self.registry.release_volume_name(name, token)

    async def mounts_node(self, body: bytes) -> str | Reply | None:
        """The node a create's volumes live on (None: it mounts none; ``SHARED``: they are
        shared volumes, any node that serves them), or the answer that refuses it. Its
        template counts when it is a snapshot pinned to a node's volumes."""
        from .gateway import Reply, _field

        names = _names(body)
        template = _field(body, "templateID")
        pinned = await self.registry.volumes_pin(template) if template else None
        if not names and pinned is None:
            return None
        homes: dict[str, str | None] = {
            f"volume {n}": await self.registry.volume_name_node(n) for n in names}
        missing = [n for n, home in homes.items() if home is None]
        if missing:
            shared = {n.record.node_id for n in await self.registry.nodes()
                      if n.record.shared_volumes}
            if not shared:
                return Reply.error(400, f"volume '{missing[0][len('volume '):]}' does not "
                                   "exist")
            local = sorted({h for h in homes.values() if h is not None})
            if local:
                return Reply.error(400, f"the volumes of node {local[0]} cannot be mounted "
                                   "with shared volumes")
            # The node checks the names; a snapshot pinned to a node that serves them
            # keeps its pin (its sandboxes are made there).
            return pinned if pinned in shared else SHARED
        if pinned is not None:
            homes[f"the volumes of snapshot {template}"] = pinned
        where = sorted({h for h in homes.values() if h is not None})
        if len(where) > 1:
            said = ", ".join(f"{n} on node {h}" for n, h in homes.items())
            return Reply.error(400, f"the volumes live on different nodes ({said}): a sandbox "
                               "mounts volumes of one node only")
        return where[0]

    async def after_sandbox_call(self, scope: Scope, reply: Reply, sandbox_id: str) -> None:
        """After a call about one sandbox went through: a persistent snapshot of a sandbox
        that mounts volumes is pinned to their node (the node's own answer says whether it
        mounts any)."""
        from .gateway import LIST_TIMEOUT_S

        if scope["method"] != "POST" or reply.status != 201 \
                or not scope["path"].rstrip("/").endswith("/snapshots"):
            return
        try:
            made = json.loads(reply.body)
            refs = [made["snapshotID"], *(made.get("names") or [])]
        except (ValueError, KeyError, TypeError):
            return
        owner = await self.registry.locate(sandbox_id)
        node = await self.registry.node(owner) if owner else None
        if node is None or node.record.shared_volumes:
            return  # shared volumes: any node that serves them makes its sandboxes
        ask: Scope = {"type": "http", "method": "GET", "path": f"/sandboxes/{sandbox_id}",
                      "query_string": b"", "headers": []}
        try:
            info = await self.gw._call(self.gw._request(node, ask, b""), LIST_TIMEOUT_S)
            mounts = json.loads(info.body).get("volumeMounts") if info.status == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            mounts = None
        if mounts:
            await self.registry.pin_to_volumes(node.record.node_id,
                                               *[r for r in refs if isinstance(r, str) and r])

    # -- content (streamed, the volume's token)

    async def content(self, scope: Scope, receive: Receive, send: Send) -> None:
        volume_id = scope["path"][len(CONTENT_PREFIX):].split("/", 1)[0]
        try:
            node = await self._node(volume_id)
            shared, any_shared = ([], False) if node is not None \
                else await self._shared_nodes()
        except (RedisError, OSError):
            return await _error(send, 503, "unavailable",
                                "the cluster's registry (Redis) is unreachable")
        if node is None and not any_shared:
            return await _error(send, 401, "unauthorized", "missing or invalid volume token")
        if node is None:
            for one in shared:  # a shared volume: any node that serves them
                if await self._stream(one, scope, receive, send, volume_id, retry=True):
                    return
            return await _error(send, 503, "unavailable",
                                "no node that serves shared volumes is reachable")
        if not node.alive:
            return await _error(send, 503, "unavailable", f"the node of volume {volume_id} "
                                f"({node.record.node_id}) is unreachable")
        await self._stream(node, scope, receive, send, volume_id, retry=False)

    async def _stream(self, node: NodeStatus, scope: Scope, receive: Receive, send: Send,
                      volume_id: str, *, retry: bool) -> bool:
        """Stream the call to ``node`` and its answer back; False (nothing sent) when
        ``retry`` and the node refused the connection, so that the next may take it."""
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP]
        has_body = scope["method"] in ("PUT", "POST", "PATCH")

        async def chunks() -> AsyncIterator[bytes]:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    # Not a normal end: that would end the chunked body upstream, and the
                    # node would take the cut upload for a whole one.
                    raise _ClientGone
                yield msg.get("body", b"")
                if not msg.get("more_body", False):
                    return

        request = self.gw.http.build_request(
            scope["method"], httpx.URL(node.record.url + scope["path"],
                                       query=scope.get("query_string") or None),
            headers=headers, content=chunks() if has_body else None)
        request.extensions["timeout"] = httpx.Timeout(
            CONTENT_TIMEOUT_S, connect=2.0).as_dict()
        try:
            response = await self.gw.http.send(request, stream=True)
        except _ClientGone:
            return True  # the upload stopped half way: the node's connection is dropped too
        except httpx.ConnectError:
            if retry:
                return False
            await _error(send, 502, "bad_gateway",
                         f"the node of volume {volume_id} did not answer: refused")
            return True
        except httpx.HTTPError as e:
            await _error(send, 502, "bad_gateway",
                         f"the node of volume {volume_id} did not answer: {e}")
            return True
        try:
            out = [(k, v) for k, v in response.headers.raw if k.lower() not in _OUT_HOP]
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": out})
            async for chunk in response.aiter_raw(CHUNK):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()
        return True


class _ClientGone(Exception):
    """The client went away in the middle of its upload."""


async def _error(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"code": code, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def content_first(app: Any, routes: VolumeRoutes) -> Any:
    """``app`` (the gateway's REST, behind its key check) with the content API's paths
    taken before it."""

    async def front(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(CONTENT_PREFIX):
            await routes.content(scope, receive, send)
        else:
            await app(scope, receive, send)

    return front
