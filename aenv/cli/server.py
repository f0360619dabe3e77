"""``aenv server``: run the API, the sandbox proxy and the orchestrator in one process.

Before anything touches the home, in this order: lock the home and the network-name prefix
(``aenv.instance_lock``), bind and listen on the port, check the API key. A second server
on the same home, prefix or port therefore exits at once with an error saying which, and
leaves the first one's VMs, network slots and files alone; crash recovery only ever runs in
the one server that holds the locks. Then TLS (``aenv.tls``): a certificate brought with
``--tls-cert``/``--tls-key`` is checked, or ``--tls-self-signed`` makes or reuses the local
CA's under ``$AENV_HOME/secrets/tls/<domain>/``; a problem there also stops the server
before it builds anything. uvicorn is then handed the socket already bound, and serves
TLS on it when asked: REST and sandbox traffic alike, so with wildcard DNS an SDK needs
only ``E2B_DOMAIN`` (``https://api.<domain>``, ``https://<port>-<id>.<domain>``).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path

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
    tls_cert: Path | None = typer.Option(
        None, "--tls-cert", envvar="AENV_TLS_CERT", dir_okay=False,
        help="serve HTTPS with this PEM certificate (chain first to last); it should "
             "cover <domain> and *.<domain>"),
    tls_key: Path | None = typer.Option(
        None, "--tls-key", envvar="AENV_TLS_KEY", dir_okay=False,
        help="the PEM private key of --tls-cert (unencrypted)"),
    tls_self_signed: bool = typer.Option(
        False, "--tls-self-signed", envvar="AENV_TLS_SELF_SIGNED",
        help="serve HTTPS with a certificate for <domain> and *.<domain> from a local CA "
             "made once under $AENV_HOME/secrets/tls/<domain>/; clients trust its ca.pem"),
) -> None:
    """Serve the E2B-compatible API and sandbox traffic on one listener."""
    import uvicorn

    from ..api.auth import ApiKeyError, load_api_key
    from ..config import Settings
    from ..instance_lock import InstanceTaken, claim_instance
    from ..tls import TlsError, listener_tls

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
        tls = listener_tls(settings.secrets_dir, domain, cert=tls_cert, key=tls_key,
                           self_signed=tls_self_signed)
    except (InstanceTaken, ListenError, ApiKeyError, TlsError) as e:
        typer.echo(f"aenv server: {e}", err=True)
        raise typer.Exit(1) from None

    from ..orchestrator.node import NodeMachines
    from ..orchestrator.service import Limits
    from ..server import Server, ServerOptions

    srv = Server(settings, NodeMachines(settings), ServerOptions(
        domain=domain, limits=Limits(max_sandboxes=max_sandboxes, max_starting=max_starting,
                      max_fork=max_fork),
        snapshot_base=snapshot_base))
    log = logging.getLogger("aenv.server")
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    log.info("data in %s; API key %s; listening on %s://%s", settings.home,
             srv.api_key_file or "from AENV_API_KEY", "https" if tls else "http", where)
    if tls is not None:
        log.info("TLS certificate %s for %s, valid until %s", tls.cert, ", ".join(tls.names),
                 tls.not_after.date())
    if tls is not None and tls.ca is not None:
        # Printed whatever the log level: clients cannot connect until they trust it.
        typer.echo(f"aenv server: TLS from the local CA {tls.ca}; clients trust it with "
                   f"SSL_CERT_FILE={tls.ca} (Python) or NODE_EXTRA_CA_CERTS={tls.ca} "
                   "(Node), or add it to the system's store", err=True)
    config = uvicorn.Config(srv.app, host=host, port=port, log_level=log_level,
                            access_log=False, timeout_keep_alive=300, lifespan="on",
                            **(tls.uvicorn_options() if tls else {}))
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
