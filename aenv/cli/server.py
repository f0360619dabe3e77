"""``aenv server``: run the API, the sandbox proxy and the orchestrator in one process."""

from __future__ import annotations

import logging
import os

import typer


def register(app: typer.Typer) -> None:
    app.command()(server)


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

    from ..config import Settings
    from ..orchestrator.node import NodeMachines
    from ..orchestrator.service import Limits
    from ..server import Server, ServerOptions

    if os.geteuid() != 0:
        typer.echo("aenv server needs root (network namespaces, taps, VMs)", err=True)
        raise typer.Exit(1)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # One line per proxied request is noise; aenv logs its own operations.
    for noisy in ("httpx", "qemu.qmp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    settings = Settings.from_env()
    srv = Server(settings, NodeMachines(settings), ServerOptions(
        domain=domain, limits=Limits(max_sandboxes=max_sandboxes, max_starting=max_starting,
                      max_fork=max_fork),
        snapshot_base=snapshot_base))
    logging.getLogger("aenv.server").info(
        "data in %s; API key %s; listening on http://%s:%d", settings.home,
        srv.api_key_file or "from AENV_API_KEY", host, port)
    uvicorn.run(srv.app, host=host, port=port, log_level=log_level, access_log=False,
                timeout_keep_alive=300, lifespan="on")
