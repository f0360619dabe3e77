"""How the CLI finds the aenv server and its API key, and how it reports failures.

The server URL is ``--url``, else ``AENV_URL``, else ``E2B_API_URL``, else
``http://127.0.0.1:3000``. The key is ``AENV_API_KEY``, else ``E2B_API_KEY``, else — when
the server is on this machine — the file the server keeps it in,
``$AENV_HOME/secrets/api-key``; the variables are ``aenv.config.ClientSettings``'s.
Commands run inside ``session()``, which turns every expected failure (no server, wrong
key, unknown sandbox, envd errors) into one line on stderr and exit status 1 instead of a
traceback.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import typer
from rich.console import Console

from ..client.api import ApiClient, ApiError, Unauthorized, Unreachable
from ..client.envd import EnvdError
from ..config import DEFAULT_URL, ClientSettings, Settings, SettingsError


def _url_option() -> Any:
    """``--url``: None unless given, so ``ClientSettings.url`` (its variables) stands."""
    _, var = ClientSettings.declared("url")
    if var.flag is None:
        raise TypeError("ClientSettings.url declares no flag= for --url")
    return typer.Option(None, var.flag, show_default=False,
                        help=f"aenv server URL (env {', else '.join(var.names)}; "
                             f"default {DEFAULT_URL})")


UrlOption = _url_option()

stderr = Console(stderr=True, highlight=False, soft_wrap=True)


class ConnectionSetupError(Exception):
    """The CLI cannot work out how to talk to the server (no key, bad URL)."""


@dataclass(frozen=True)
class Connection:
    url: str
    api_key: str


def is_local(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def key_file() -> Path:
    try:
        return Settings.from_env().secrets_dir / "api-key"
    except SettingsError as e:
        raise ConnectionSetupError(f"cannot find the server's key file: {e}") from None


def resolve(url: str | None) -> Connection:
    """``url`` is ``--url``'s value (None when not given)."""
    client = ClientSettings.from_env()
    url = (url or client.url).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConnectionSetupError(f"invalid server URL '{url}': expected http(s)://host:port")
    if client.api_key:
        return Connection(url, client.api_key)
    if not is_local(url):
        raise ConnectionSetupError(
            f"no API key for {url}: set AENV_API_KEY (or E2B_API_KEY)")
    path = key_file()
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        raise ConnectionSetupError(
            f"no API key: set AENV_API_KEY, or start the server so it writes {path}"
        ) from None
    except PermissionError:
        raise ConnectionSetupError(
            f"no API key: {path} is not readable by this user; set AENV_API_KEY "
            "or run as the server's user") from None
    if not key:
        raise ConnectionSetupError(f"no API key: {path} is empty; set AENV_API_KEY")
    return Connection(url, key)


def describe(e: Exception, url: str | None = None) -> str:
    """One line saying what went wrong and, where it helps, what to do."""
    if isinstance(e, Unreachable):
        return f"{e.message}; is `aenv server` running? (--url / AENV_URL)"
    if isinstance(e, Unauthorized):
        where = f" by {url}" if url else ""
        return (f"API key rejected{where} (401: {e.message}); "
                "check AENV_API_KEY / E2B_API_KEY")
    if isinstance(e, ApiError):
        return e.message if e.status == 0 else f"{e.message} ({e.status})"
    if isinstance(e, EnvdError):
        if e.code == "unavailable" and "was not found" in e.message:
            return "the sandbox is not running (killed, paused or timed out)"
        return f"sandbox: {e}"
    return str(e)


def fail(message: str, code: int = 1) -> typer.Exit:
    stderr.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


@contextmanager
def session(url: str | None, *, error_status: int = 1) -> Iterator[ApiClient]:
    """An API client for the resolved server; expected failures become ``fail()`` with
    ``error_status`` (exec and shell use 255, as ssh does, so that it cannot be mistaken
    for the remote command's own status)."""
    conn: Connection | None = None
    try:
        conn = resolve(url)
        with ApiClient(conn.url, conn.api_key) as api:
            yield api
    except (ApiError, EnvdError, ConnectionSetupError) as e:
        raise fail(describe(e, conn.url if conn else None), error_status) from None
    except httpx.HTTPError as e:
        where = conn.url if conn else "the server"
        raise fail(f"lost the connection to {where}: {e or type(e).__name__}",
                   error_status) from None
