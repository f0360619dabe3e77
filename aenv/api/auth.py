"""API-key authentication: ``X-API-KEY`` on every REST call except ``/health``, ``/metrics``.

The key is ``AENV_API_KEY`` when set (``Settings.api_key``, which the caller passes; an
empty value counts as unset, as docker-compose passes one), else read from
``AENV_HOME/secrets/api-key``, else generated there as ``e2b_``
+ 40 hex digits (the form some SDK versions check), mode 0600. A new key is written whole
or not at all: temporary file, fsync, link into place, fsync of the directory.

A key must be at least ``MIN_KEY_LENGTH`` printable ASCII characters without spaces;
anything else is an ``ApiKeyError`` naming the variable or file, and the server does not
start. The one exception is a key file of zero bytes, which older versions could leave
after a crash between creating and writing it: no client can hold a key that was never
written, so it is replaced by a fresh key rather than refused. The middleware refuses a
short key too, and never lets an empty ``X-API-KEY`` through.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from ..storage import durable
from .errors import error_response

log = logging.getLogger(__name__)

MIN_KEY_LENGTH = 32
ENV_VAR = "AENV_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})
# COPY archives are PUT by the SDK without an API key; that URL carries its own HMAC token.
_SIGNED_UPLOAD = re.compile(r"^/templates/[^/]+/files/[^/]+/upload$")
_KEY_CHARS = re.compile(r"[\x21-\x7e]+")  # what an HTTP header carries unchanged


class ApiKeyError(Exception):
    """The configured API key cannot be used; the message says where it came from and
    what to do."""


def _problem(key: str) -> str | None:
    if len(key) < MIN_KEY_LENGTH:
        return f"is {len(key)} characters long; aenv needs at least {MIN_KEY_LENGTH}"
    if not _KEY_CHARS.fullmatch(key):
        return "holds spaces, control or non-ASCII characters"
    return None


def load_api_key(secrets_dir: Path, configured: str | None = None
                 ) -> tuple[str, Path | None]:
    """(key, file it lives in or None when it came from the environment): ``configured``
    (``Settings.api_key``, from ``AENV_API_KEY``) when given, else the key file's."""
    env = (configured or "").strip()
    if env:
        if problem := _problem(env):
            raise ApiKeyError(f"the API key in {ENV_VAR} {problem}; "
                              f"set a longer one (e.g. e2b_ + 40 hex digits)")
        return env, None
    path = secrets_dir / "api-key"
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return _write_new_key(path, replace=False), path
    except (OSError, UnicodeError) as e:
        raise ApiKeyError(f"cannot read the API key file {path}: {e}") from None
    if raw == "":
        log.warning("API key file %s is empty (left by a crash while it was first written): "
                    "writing a new key", path)
        return _write_new_key(path, replace=True), path
    key = raw.strip()
    if problem := _problem(key):
        raise ApiKeyError(f"the API key in {path} {problem}; put a longer key there, delete "
                          f"the file to have a new one generated, or set {ENV_VAR}")
    return key, path


def _write_new_key(path: Path, replace: bool) -> str:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = "e2b_" + secrets.token_hex(20)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.write(fd, (key + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # unlike rename, never replaces a key written meanwhile
            except FileExistsError:
                return load_api_key(path.parent)[0]
    finally:
        tmp.unlink(missing_ok=True)
    durable.fsync_dir(path.parent)
    return key


class ApiKeyMiddleware:
    """``cluster_secret``: a node in a cluster also lets in a call that carries it in
    ``X-Aenv-Cluster-Secret`` (a gateway's, see ``aenv.cluster.trust``)."""

    def __init__(self, app: ASGIApp, key: str, cluster_secret: str | None = None) -> None:
        if problem := _problem(key):
            raise ValueError(f"the API key {problem}")
        if cluster_secret is not None and (problem := _problem(cluster_secret)):
            raise ValueError(f"the cluster secret {problem}")
        self.app = app
        self.key = key.encode()
        self.secret = cluster_secret.encode() if cluster_secret else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in OPEN_PATHS or (scope["method"] == "PUT" and _SIGNED_UPLOAD.match(path)):
            return await self.app(scope, receive, send)
        if self.secret is not None:
            secret = [v for k, v in scope["headers"] if k == b"x-aenv-cluster-secret"]
            if len(secret) == 1 and hmac.compare_digest(secret[0], self.secret):
                return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k == b"x-api-key"]
        if len(given) != 1 or not given[0] or not hmac.compare_digest(given[0], self.key):
            msg = "missing API key (X-API-KEY)" if not any(given) else "invalid API key"
            return await error_response(401, msg)(scope, receive, send)
        await self.app(scope, receive, send)
