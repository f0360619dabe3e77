"""A synchronous client for an aenv server's REST API (the E2B API plus aenv's extensions).

It sends what the E2B SDK sends (``X-API-KEY``, the same paths, bodies and query encodings)
and returns the JSON it gets back as plain dicts, so it stays a thin, honest layer: the
CLI decides how to show things. Every failure is an ``ApiError``; its subclasses say what
the caller can do about it (``Unreachable``: is the server running; ``Unauthorized``: the
key; ``NotFound``; ``Conflict``: wrong state).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType
from typing import IO, Any
from urllib.parse import quote, urlencode

import httpx

from .http import tls_verification

USER_AGENT = "aenv-cli"
# Generous: a create waits for the sandbox's envd to answer.
DEFAULT_TIMEOUT_S = 120.0
# Uploading a COPY archive may take long; the SDK allows an hour as well.
UPLOAD_TIMEOUT_S = 3600.0


class ApiError(Exception):
    """The server refused the request (``status`` >= 300) or could not be reached
    (``status`` 0). ``message`` is the server's own ``message`` when it sent one."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message


class Unreachable(ApiError):
    def __init__(self, url: str, reason: str) -> None:
        super().__init__(0, f"cannot reach the aenv server at {url} ({reason})")
        self.url = url


class Unauthorized(ApiError):
    """401: the API key is missing or wrong."""


class NotFound(ApiError):
    """404: no such sandbox, template or build."""


class Conflict(ApiError):
    """409: the object is in a state that does not allow the operation."""


_BY_STATUS: dict[int, type[ApiError]] = {401: Unauthorized, 404: NotFound, 409: Conflict}


def path_param(value: str) -> str:
    """One path segment; template names may hold ``/`` and ``:`` (as the SDK encodes)."""
    return quote(value, safe="")


def metadata_filter(metadata: dict[str, str]) -> str:
    """The ``metadata`` list parameter as the SDK builds it (spec 2.5): each key and value
    percent-encoded, joined as a query string (which the query encoding then escapes
    once more)."""
    return urlencode({quote(k): quote(v) for k, v in metadata.items()})


class ApiClient:
    def __init__(self, url: str, api_key: str, *, timeout: float = DEFAULT_TIMEOUT_S,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(
            base_url=self.url, timeout=httpx.Timeout(timeout, connect=5.0),
            headers={"X-API-KEY": api_key, "User-Agent": USER_AGENT},
            transport=transport, follow_redirects=False, verify=tls_verification())

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise Unreachable(self.url, _reason(e)) from e
        if r.status_code >= 300:
            raise _error(r)
        return r

    # -- sandboxes ------------------------------------------------------------------------

    def create_sandbox(self, template: str, *, timeout: int | None = None,
                       metadata: dict[str, str] | None = None,
                       env_vars: dict[str, str] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"templateID": template, "metadata": metadata or {},
                                "envVars": env_vars or {}}
        if timeout is not None:
            body["timeout"] = timeout
        return _object(self._request("POST", "/v2/sandboxes", json=body))

    def list_sandboxes(self, *, states: list[str] | None = None,
                       metadata: dict[str, str] | None = None,
                       page_size: int = 100) -> list[dict[str, Any]]:
        """Every live sandbox matching the filters, newest first (all pages)."""
        params: dict[str, Any] = {"limit": page_size}
        if states:
            params["state"] = ",".join(states)
        if metadata:
            params["metadata"] = metadata_filter(metadata)
        out: list[dict[str, Any]] = []
        while True:
            r = self._request("GET", "/v2/sandboxes", params=params)
            out.extend(_objects(r))
            token = r.headers.get("X-Next-Token")
            if not token:
                return out
            params["nextToken"] = token

    def get_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        return _object(self._request("GET", f"/sandboxes/{path_param(sandbox_id)}"))

    def kill_sandbox(self, sandbox_id: str) -> None:
        self._request("DELETE", f"/sandboxes/{path_param(sandbox_id)}")

    def pause_sandbox(self, sandbox_id: str) -> None:
        self._request("POST", f"/sandboxes/{path_param(sandbox_id)}/pause", json={})

    def fork_sandbox(self, sandbox_id: str, count: int,
                     timeout: int | None = None) -> list[dict[str, Any]]:
        """One entry per child: ``{"sandbox": {...}}`` or ``{"error": {code, message}}``."""
        body: dict[str, Any] = {"count": count}
        if timeout is not None:
            body["timeout"] = timeout
        return _objects(self._request("POST", f"/sandboxes/{path_param(sandbox_id)}/fork",
                                      json=body))

    def snapshot_sandbox(self, sandbox_id: str, name: str | None = None) -> dict[str, Any]:
        body = {"name": name} if name else {}
        return _object(self._request("POST", f"/sandboxes/{path_param(sandbox_id)}/snapshots",
                                     json=body))

    def connect_sandbox(self, sandbox_id: str,
                        timeout: int | None = None) -> tuple[dict[str, Any], bool]:
        """v2 connect: resumes a paused sandbox. Returns (sandbox, resumed) — the server
        answers 201 when it resumed and 200 when the sandbox was already running."""
        body = {} if timeout is None else {"timeout": timeout}
        r = self._request("POST", f"/v2/sandboxes/{path_param(sandbox_id)}/connect",
                          json=body)
        return _object(r), r.status_code == 201

    # -- templates (the E2B build API, as Template.build drives it) -------------------------

    def request_build(self, name: str, *, tags: list[str] | None = None,
                      cpu_count: int | None = None,
                      memory_mb: int | None = None) -> dict[str, Any]:
        """``POST /v3/templates``: reserve (or reuse) the template and a new build;
        answers ``templateID`` and ``buildID``."""
        body: dict[str, Any] = {"name": name}
        if tags:
            body["tags"] = tags
        if cpu_count is not None:
            body["cpuCount"] = cpu_count
        if memory_mb is not None:
            body["memoryMB"] = memory_mb
        return _object(self._request("POST", "/v3/templates", json=body))

    def file_upload_link(self, template_id: str, files_hash: str) -> dict[str, Any]:
        """``{present, url?, headers?}``: whether the server has this COPY archive, and
        where to PUT it when not."""
        return _object(self._request(
            "GET", f"/templates/{path_param(template_id)}/files/{files_hash}"))

    def upload_files(self, url: str, archive: IO[bytes], size: int,
                     headers: dict[str, str] | None = None) -> None:
        """PUT a COPY archive to the link from ``file_upload_link``. The link carries its
        own authorisation (it may point elsewhere), so no API key goes with it."""
        sent = {k: v for k, v in (headers or {}).items() if k.lower() != "content-length"}
        sent["Content-Length"] = str(size)
        try:
            r = httpx.put(url, content=_chunks(archive), headers=sent,
                          timeout=httpx.Timeout(UPLOAD_TIMEOUT_S, connect=5.0))
        except httpx.TransportError as e:
            raise Unreachable(url.split("?")[0], _reason(e)) from e
        if r.status_code >= 300:
            raise _error(r)

    def start_build(self, template_id: str, build_id: str, spec: dict[str, Any]) -> None:
        """``POST /v2/templates/{tid}/builds/{bid}`` with the steps (TemplateBuildStartV2)."""
        self._request("POST", f"/v2/templates/{path_param(template_id)}/builds/{build_id}",
                      json=spec)

    def build_status(self, template_id: str, build_id: str,
                     logs_offset: int = 0) -> dict[str, Any]:
        """``{status, logEntries, reason?}``; log entries from ``logs_offset`` on."""
        return _object(self._request(
            "GET", f"/templates/{path_param(template_id)}/builds/{build_id}/status",
            params={"logsOffset": logs_offset}))

    def list_templates(self) -> list[dict[str, Any]]:
        return _objects(self._request("GET", "/templates"))

    def delete_template(self, id_or_name: str) -> None:
        self._request("DELETE", f"/templates/{path_param(id_or_name)}")


def _chunks(f: IO[bytes], size: int = 1 << 20) -> Iterator[bytes]:
    while block := f.read(size):
        yield block


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError as e:
        raise ApiError(r.status_code, f"the server's answer is not JSON: {r.text[:200]!r}") from e


def _object(r: httpx.Response) -> dict[str, Any]:
    """The answer's JSON object; any other answer is an ``ApiError``, not a ``ValueError``
    or a wrong type deep in the caller."""
    body = _json(r)
    if not isinstance(body, dict):
        raise ApiError(r.status_code, f"the server answered {type(body).__name__}, "
                                      "not a JSON object")
    return body


def _objects(r: httpx.Response) -> list[dict[str, Any]]:
    """The answer's JSON list of objects, checked like ``_object``."""
    body = _json(r)
    if not isinstance(body, list) or not all(isinstance(x, dict) for x in body):
        raise ApiError(r.status_code, "the server's answer is not a JSON list of objects")
    return body


def _reason(e: httpx.TransportError) -> str:
    if isinstance(e, httpx.ConnectError):
        return "connection refused" if "refused" in str(e).lower() else f"cannot connect: {e}"
    if isinstance(e, httpx.TimeoutException):
        return "timed out"
    return str(e) or type(e).__name__


def _error(r: httpx.Response) -> ApiError:
    try:
        body = r.json()
        message = str(body.get("message")) if isinstance(body, dict) and "message" in body \
            else r.text[:200]
    except ValueError:
        message = r.text[:200].strip() or r.reason_phrase
    return _BY_STATUS.get(r.status_code, ApiError)(r.status_code, message)
