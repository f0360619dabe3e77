"""``GET /files`` (download) and ``POST /files`` (upload) over HTTP.

Both check access first (``signing.check``: the ``X-Access-Token`` header or a signed
URL; 401; signed URLs without an expiration are refused too when
``AENV_ENVD_REQUIRE_SIGNATURE_EXPIRATION=1`` was set when envd started), then resolve the
user (``username`` query parameter, else the default user; an unknown one is 401), then
the path (relative to the user's home, ``~`` expanded, empty = default workdir). The user
only decides those paths and who owns what an upload creates: envd, running as root,
checks no per-user permissions (see the filesystem service). Every error answers
``{"code": <status>, "message": ...}``.

Uploads take ``application/octet-stream`` (``path`` required) or ``multipart/form-data``
(parts named ``file``; the target is the ``path`` parameter, else the part's full
``filename``; two parts to one target are a 400; results in request order), either one
optionally ``Content-Encoding: gzip``. ``X-Metadata-<Key>`` headers become the files'
``user.e2b.<key>`` xattrs.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import signing
from ..errors import json_error
from ..filesystem import metadata as xattrs
from ..state import EnvdState
from ..users import UnknownUser, User, resolve_path
from .download import FileDownload, is_conditional, open_regular
from .encoding import GZIP, IDENTITY, identity_acceptable, negotiate, request_coding
from .errors import FilesHTTPError
from .gzip_stream import GzipDecodeError, gunzip
from .multipart import MultipartError, MultipartReader, parse_header_params
from .upload import write_file

_METADATA_PREFIX = b"x-metadata-"
# What a refused upload may still send before the answer goes out (``_refused``).
DRAIN_BYTES = 1 << 20
DRAIN_S = 2.0


@dataclass(frozen=True)
class _Query:
    path: str | None
    username: str | None
    signature: str | None
    expiration: int | None

    @classmethod
    def of(cls, request: Request) -> _Query:
        q = request.query_params
        raw_exp = q.get("signature_expiration")
        try:
            expiration = int(raw_exp) if raw_exp is not None else None
        except ValueError:
            raise FilesHTTPError(
                400, f"Invalid format for parameter signature_expiration: {raw_exp!r}"
            ) from None
        return cls(q.get("path"), q.get("username"), q.get("signature"), expiration)


def _authorize(state: EnvdState, request: Request, q: _Query, operation: signing.Operation,
               require_expiration: bool) -> User:
    try:
        signing.check(
            state,
            header_token=request.headers.get("x-access-token"),
            signature_param=q.signature,
            expiration=q.expiration,
            username=q.username,
            path=q.path or "",
            operation=operation,
            require_expiration=require_expiration,
        )
    except signing.SigningError as e:
        raise FilesHTTPError(401, str(e)) from None
    name = q.username if q.username is not None else state.default_user
    try:
        return User.lookup(name)
    except UnknownUser:
        raise FilesHTTPError(
            401, f"error looking up user '{name}': user: unknown user {name}"
        ) from None


def _metadata(request: Request) -> dict[str, str]:
    found: dict[str, str] = {}
    for name, value in request.headers.raw:
        if name.lower().startswith(_METADATA_PREFIX):
            key = name[len(_METADATA_PREFIX) :].decode("latin-1").lower()
            if key:
                found.setdefault(key, value.decode("latin-1"))
    try:
        xattrs.validate(found)
    except xattrs.InvalidMetadata as e:
        raise FilesHTTPError(400, f"invalid metadata: {e}") from None
    return found


async def _refused(request: Request, answer: Response) -> Response:
    """Read (and drop) what is left of a refused upload's body, up to ``DRAIN_BYTES`` and
    ``DRAIN_S``, before answering. A server that answers while the client is still sending
    closes a connection the client may be writing to: the client can then get a reset
    instead of the answer (seen as a transport error in the SDK, under load). Go's
    net/http, E2B's envd, drains up to 256 KiB the same way."""
    seen = 0
    try:
        async with asyncio.timeout(DRAIN_S):
            async for chunk in request.stream():
                seen += len(chunk)
                if seen > DRAIN_BYTES:
                    break
    except (TimeoutError, ClientDisconnect, RuntimeError):  # RuntimeError: already read
        pass
    return answer


def routes(state: EnvdState, *, require_signature_expiration: bool | None = None) -> list[Route]:
    """The two ``/files`` routes. ``require_signature_expiration`` None means the
    environment decides (``AENV_ENVD_REQUIRE_SIGNATURE_EXPIRATION``, read once here)."""
    strict = (signing.expiration_required_by_env() if require_signature_expiration is None
              else require_signature_expiration)

    async def download(request: Request) -> Response | FileDownload:
        try:
            q = _Query.of(request)
            user = _authorize(state, request, q, "read", strict)
            path = resolve_path(q.path or "", user, state.default_workdir)
            fd, st = open_regular(path)
            try:
                coding = negotiate(request.headers.get("accept-encoding"))
                if is_conditional(request.headers):
                    if not identity_acceptable(request.headers.get("accept-encoding")):
                        raise FilesHTTPError(
                            406, "identity encoding not acceptable for Range or conditional request"
                        )
                    coding = IDENTITY
            except FilesHTTPError:
                os.close(fd)
                raise
            return FileDownload(fd, st, q.path or "", path, coding, request.headers, request.method)
        except FilesHTTPError as e:
            return json_error(e.status, e.message)

    async def upload(request: Request) -> Response:
        try:
            q = _Query.of(request)
            coding = request_coding(request.headers.get("content-encoding"))
            user = _authorize(state, request, q, "write", strict)
            metadata = _metadata(request)
            content_type = request.headers.get("content-type", "")
            try:
                media_type, params = parse_header_params(content_type)
            except MultipartError:
                media_type, params = "", {}
            body: AsyncIterator[bytes] = request.stream()
            if coding == GZIP:
                body = gunzip(body)
            if media_type == "application/octet-stream":
                entries = [await _raw_upload(state, q, user, body, metadata)]
            elif media_type.startswith("multipart/"):
                entries = await _multipart_upload(state, q, user, body, params, metadata)
            else:
                raise FilesHTTPError(
                    400,
                    f"unsupported content type: {content_type}, "
                    "expected multipart/form-data or application/octet-stream",
                )
            return JSONResponse(entries)
        except FilesHTTPError as e:
            return await _refused(request, json_error(e.status, e.message))
        except GzipDecodeError as e:
            return await _refused(request, json_error(400, f"error decompressing request "
                                                           f"body: {e}"))
        except MultipartError as e:
            return await _refused(request, json_error(400, f"error reading form: {e}"))
        except ClientDisconnect:
            return json_error(400, "client disconnected before the upload completed")

    return [
        Route("/files", download, methods=["GET"]),
        Route("/files", upload, methods=["POST"]),
    ]


async def _raw_upload(
    state: EnvdState, q: _Query, user: User, body: AsyncIterator[bytes], metadata: dict[str, str]
) -> dict[str, object]:
    if q.path is None:
        raise FilesHTTPError(400, "path query parameter is required for raw body upload")
    path = resolve_path(q.path, user, state.default_workdir)
    # Decode the first piece before the file exists: a body that is not what its
    # Content-Encoding says must not leave an empty file behind.
    first = await anext(body, b"")

    async def whole() -> AsyncIterator[bytes]:
        yield first
        async for chunk in body:
            yield chunk

    return await write_file(path, whole(), user, metadata)


async def _multipart_upload(
    state: EnvdState,
    q: _Query,
    user: User,
    body: AsyncIterator[bytes],
    params: dict[str, str],
    metadata: dict[str, str],
) -> list[dict[str, object]]:
    reader = MultipartReader(body, params.get("boundary", ""))
    entries: list[dict[str, object]] = []
    while (part := await reader.next_part()) is not None:
        if part.name != "file":
            continue
        target = q.path if q.path is not None else part.filename
        if target is None:
            raise FilesHTTPError(
                400,
                "error getting multipart custom part file name: "
                "filename not found in Content-Disposition header",
            )
        path = resolve_path(target, user, state.default_workdir)
        done = [str(e["path"]) for e in entries]
        if path in done:
            message = (
                f"you cannot upload multiple files to the same path '{path}' in one upload "
                "request, only the first specified file was uploaded"
            )
            others = [p for p in done if p != path]
            if len(others) > 1:
                message += f", also the following files were uploaded: {', '.join(others)}"
            raise FilesHTTPError(400, message)
        entries.append(await write_file(path, aiter(part), user, metadata))
    return entries
