"""Mount a Connect-RPC service implementation from its protobuf descriptor.

connectrpc's code generator for Python is not on PyPI, so instead of generated
``*_connect.py`` glue we build the endpoint table from the service descriptor that
protoc-gen-py emits. A service implementation is a plain object with one method per RPC,
named in snake_case (``Start`` -> ``start``, ``GetWatcherEvents`` -> ``get_watcher_events``):
unary and client-streaming methods are coroutines, server-streaming methods async generators.

Every SDK speaks the JSON codec only and some send fields we do not know; connectrpc's JSON
codec ignores unknown fields, which is what the wire contract asks of a server.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from connectrpc.code import Code
from connectrpc.codec import proto_json_codec
from connectrpc.compression import Compression
from connectrpc.errors import ConnectError
from connectrpc.method import IdempotencyLevel, MethodInfo
from connectrpc.server import ConnectASGIApplication, Endpoint

if TYPE_CHECKING:
    # connectrpc exports only the base class; its ASGI app takes the closed union of the
    # four kinds (connectrpc._server_async.Endpoint, a private alias).
    from connectrpc._server_shared import (
        EndpointBidiStream,
        EndpointClientStream,
        EndpointServerStream,
        EndpointUnary,
    )

    AnyEndpoint = (EndpointUnary[Any, Any] | EndpointServerStream[Any, Any]
                   | EndpointClientStream[Any, Any] | EndpointBidiStream[Any, Any])

_KINDS: dict[str, Callable[..., AnyEndpoint]] = {
    "unary": Endpoint.unary,
    "server_streaming": Endpoint.server_stream,
    "client_streaming": Endpoint.client_stream,
    "bidi_streaming": Endpoint.bidi_stream,
}

# Stream envelopes carry whole messages; uploads go over /files, not RPC.
READ_MAX_BYTES = 16 * 1024 * 1024


def snake_case(name: str) -> str:
    """``GetWatcherEvents`` -> ``get_watcher_events``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class _TolerantJSON:
    """connectrpc's JSON codec, with undecodable bodies answered as ``invalid_argument``
    (connectrpc would let the decode error escape as a 500)."""

    def __init__(self) -> None:
        self._inner = proto_json_codec()

    def name(self) -> str:
        return self._inner.name()

    def encode(self, message: Any) -> bytes:
        return self._inner.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except Exception as e:
            raise ConnectError(Code.INVALID_ARGUMENT, f"invalid request body: {e}") from None


class ConnectService(ConnectASGIApplication[Any]):
    """ASGI app serving ``service`` under ``/<package>.<Service>/<Method>``."""

    def __init__(self, service: object, pb: ModuleType, type_name: str) -> None:
        desc = next(s for s in pb.desc().services if s.type_name == type_name)
        self._path = f"/{type_name}"

        def endpoints(svc: object) -> dict[str, AnyEndpoint]:
            table: dict[str, AnyEndpoint] = {}
            for m in desc.methods:
                info = MethodInfo(
                    name=m.name,
                    service_name=type_name,
                    input=getattr(pb, m.input.name),
                    output=getattr(pb, m.output.name),
                    idempotency_level=IdempotencyLevel.UNKNOWN,
                )
                make = _KINDS[m.method_kind]
                table[f"{self._path}/{m.name}"] = make(
                    method=info, function=getattr(svc, snake_case(m.name))
                )
            return table

        super().__init__(
            service=service,
            endpoints=endpoints,
            codecs=[_TolerantJSON()],
            compressions=list[Compression](),
            read_max_bytes=READ_MAX_BYTES,
        )

    @property
    def path(self) -> str:
        return self._path
