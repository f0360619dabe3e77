"""``aenv server``: run the API, the sandbox proxy and the orchestrator in one process.

Before anything touches the home, in this order: lock the home and the network-name prefix
(``aenv.instance_lock``), bind and listen on the port, check the API key. A second server
on the same home, prefix or port therefore exits at once with an error saying which, and
leaves the first one's VMs, network slots and files alone; crash recovery only ever runs in
the one server that holds the locks. uvicorn is then handed the socket already bound.
"""

from __future__ import annotations

import errno
import logging
import os
import socket

import typer


def register(app: typer.Typer) -> None:
    app.command()(server)


class ListenError(Exception):
    pass


def _listen(host: str, port: int) -> socket.socket:
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


def server(
    host: str = typer.Option("127.0.0.1", envvar="AENV_LISTEN_HOST", help="address to listen on"),
    port: int = typer.Option(3000, envvar="AENV_LISTEN_PORT", help="port for API and proxy"),
    domain: str = typer.Option(
        "localhost", envvar="AENV_DOMAIN",
        help="domain returned to SDKs; sandbox hosts are <port>-<id>.<domain>"),
    max_sandboxes: int = typer.Option(64, envvar="AENV_MAX_SANDBOXES"),
    max_starting: int = typer.Option(8, envvar="AENV_MAX_STARTING"),
    max_fork: int = typer.Option(16, envvar="AENV_MAX_FORK", help="most children per fork"),
    log_level: str = typer.Option("info", envvar="AENV_LOG_LEVEL"),
    snapshot_base: bool = typer.Option(
        True, "--snapshot-base/--no-snapshot-base", envvar="AENV_SNAPSHOT_BASE",
        help="keep 'base' as a snapshot so creates restore instead of booting"),
) -> None:
    """Serve the E2B-compatible API and sandbox traffic on one listener."""
    import uvicorn

    from ..api.auth import ApiKeyError, load_api_key
    from ..config import Settings
    from ..instance_lock import InstanceTaken, claim_instance

    if os.geteuid() != 0:
        typer.echo("aenv server needs root (network namespaces, taps, VMs)", err=True)
        raise typer.Exit(1)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # One line per proxied request is noise; aenv logs its own operations.
    for noisy in ("httpx", "qemu.qmp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    settings = Settings.from_env()
    try:
        lock = claim_instance(settings)  # held until the process exits
        sock = _listen(host, port)
        load_api_key(settings.secrets_dir)  # refuse a bad key before building anything
    except (InstanceTaken, ListenError, ApiKeyError) as e:
        typer.echo(f"aenv server: {e}", err=True)
        raise typer.Exit(1) from None

    from ..orchestrator.node import NodeMachines
    from ..orchestrator.service import Limits
    from ..server import Server, ServerOptions

    srv = Server(settings, NodeMachines(settings), ServerOptions(
        domain=domain, limits=Limits(max_sandboxes=max_sandboxes, max_starting=max_starting,
                      max_fork=max_fork),
        snapshot_base=snapshot_base))
    logging.getLogger("aenv.server").info(
        "data in %s; API key %s; listening on http://%s:%d", settings.home,
        srv.api_key_file or "from AENV_API_KEY", host, port)
    config = uvicorn.Config(srv.app, host=host, port=port, log_level=log_level,
                            access_log=False, timeout_keep_alive=300, lifespan="on")
    uv = uvicorn.Server(config)
    try:
        # After a signal uvicorn re-raises it once shut down: SIGTERM then ends the
        # process with the usual status, SIGINT arrives here as KeyboardInterrupt.
        uv.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        lock.release()
    if not uv.started:
        raise typer.Exit(3)  # what uvicorn.run exits with when the startup failed
