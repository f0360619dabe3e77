"""What ``aenv server`` and ``aenv gateway`` share: options named after settings, the
listening socket (bound before anything else, so a taken port fails at once), the settings
they run with, and uvicorn's run on that socket.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import typer

from ..config import Settings

if TYPE_CHECKING:
    import uvicorn


class ListenError(Exception):
    pass


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (close-on-exec: VMMs must not inherit it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Lets a restarted server bind while the old one's connections sit in TIME_WAIT;
        # still fails while anything listens there.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        if e.errno == errno.EADDRINUSE:
            raise ListenError(f"cannot listen on {where}: the port is in use (another aenv "
                              "server?); pick another with --port / AENV_LISTEN_PORT") from None
        raise ListenError(f"cannot listen on {where}: {e.strerror or e}") from None
    return sock


def flag(name: str, **options: Any) -> Any:
    """The option for setting ``name`` (its ``flag=`` in aenv.config): None unless given,
    so the settings' value stands (the variable's, else the declared default)."""
    f, var = Settings.declared(name)
    if var.flag is None:
        raise TypeError(f"setting {name!r} declares no flag= (aenv.config): no option")
    default = (var.shown or Settings.default_text(f) or "unset").replace("`", "")
    return typer.Option(None, var.flag, show_default=False, **options,
                        help=f"{var.doc.replace('`', '')} (env {var.name}, default {default})")


def server_settings(given: dict[str, Any], environ: Mapping[str, str] | None = None
                    ) -> Settings:
    """The settings ``aenv server`` runs with: its flags (``given``, None where absent)
    over the environment over the declared defaults."""
    flags = {f.name: v.flag.split("/")[0] for f, v in Settings.variables() if v.flag}
    return Settings.from_env(environ).override(given, flags)


def run(uv: uvicorn.Server, sock: socket.socket, *, then: Callable[[], None] | None = None
        ) -> None:
    """Serve on ``sock`` until a signal stops uvicorn; close the socket and call ``then``
    whatever happens. A startup that failed (the app's lifespan) exits with 3, as
    ``uvicorn.run`` would."""
    try:
        # After a signal uvicorn re-raises it once shut down: SIGTERM then ends the
        # process with the usual status, SIGINT arrives here as KeyboardInterrupt.
        uv.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        if then is not None:
            then()
    if not uv.started:
        raise typer.Exit(3)
