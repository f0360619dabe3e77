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

What it runs with is ``aenv.config.Settings``: each flag is a setting's ``flag=`` and, when
given, wins over the setting's variable, which wins over the declared default; a bad
value of either stops the server at once with an error naming the flag or the variable.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import typer

from ..config import Settings, SettingsError


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


def _flag(name: str, **options: Any) -> Any:
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


def server(
    host: str | None = _flag("listen_host"),
    port: int | None = _flag("listen_port"),
    domain: str | None = _flag("domain"),
    max_sandboxes: int | None = _flag("max_sandboxes"),
    max_starting: int | None = _flag("max_starting"),
    max_fork: int | None = _flag("max_fork"),
    log_level: str | None = _flag("log_level"),
    snapshot_base: bool | None = _flag("snapshot_base"),
    tls_cert: Path | None = _flag("tls_cert", dir_okay=False),
    tls_key: Path | None = _flag("tls_key", dir_okay=False),
    tls_self_signed: bool | None = _flag("tls_self_signed"),
    cluster: str | None = _flag("cluster"),
    node_id: str | None = _flag("node_id"),
    advertise: str | None = _flag("advertise_url"),
) -> None:
    """Serve the E2B-compatible API and sandbox traffic on one listener."""
    import uvicorn

    from ..api.auth import ApiKeyError, load_api_key
    from ..cluster.node_setup import NodeSetupError
    from ..cluster.node_setup import check as cluster_check
    from ..instance_lock import InstanceTaken, claim_instance
    from ..tls import TlsError, listener_tls

    if os.geteuid() != 0:
        typer.echo("aenv server needs root (network namespaces, taps, VMs)", err=True)
        raise typer.Exit(1)
    try:
        settings = server_settings({
            "listen_host": host, "listen_port": port, "domain": domain,
            "max_sandboxes": max_sandboxes, "max_starting": max_starting,
            "max_fork": max_fork, "log_level": log_level and log_level.lower(),
            "snapshot_base": snapshot_base, "tls_cert": tls_cert, "tls_key": tls_key,
            "tls_self_signed": tls_self_signed, "cluster": cluster, "node_id": node_id,
            "advertise_url": advertise})
        cluster_check(settings)
    except (SettingsError, NodeSetupError) as e:
        typer.echo(f"aenv server: {e}", err=True)
        raise typer.Exit(1) from None
    s = settings
    logging.basicConfig(level=s.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # One line per proxied request is noise; aenv logs its own operations.
    for noisy in ("httpx", "qemu.qmp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    log = logging.getLogger("aenv.server")
    log.debug("%r", s)  # the API key shows as <hidden>
    try:
        lock = claim_instance(s)  # held until the process exits
        sock = _listen(s.listen_host, s.listen_port)
        load_api_key(s.secrets_dir, s.api_key)  # refuse a bad key before building anything
        tls = listener_tls(s.secrets_dir, s.domain, cert=s.tls_cert, key=s.tls_key,
                           self_signed=s.tls_self_signed)
    except (InstanceTaken, ListenError, ApiKeyError, TlsError) as e:
        typer.echo(f"aenv server: {e}", err=True)
        raise typer.Exit(1) from None

    from ..cluster.drain import DrainingServer
    from ..orchestrator.node import NodeMachines
    from ..server import Server, ServerOptions

    srv = Server(s, NodeMachines(s), ServerOptions.from_settings(s))
    host, port = s.listen_host, s.listen_port
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    log.info("data in %s; API key %s; listening on %s://%s", s.home,
             srv.api_key_file or "from AENV_API_KEY", "https" if tls else "http", where)
    if tls is not None:
        log.info("TLS certificate %s for %s, valid until %s", tls.cert, ", ".join(tls.names),
                 tls.not_after.date())
    if tls is not None and tls.ca is not None:
        # Printed whatever the log level: clients cannot connect until they trust it.
        typer.echo(f"aenv server: TLS from the local CA {tls.ca}; clients trust it with "
                   f"SSL_CERT_FILE={tls.ca} (Python) or NODE_EXTRA_CA_CERTS={tls.ca} "
                   "(Node), or add it to the system's store", err=True)
    config = uvicorn.Config(srv.app, host=host, port=port, log_level=s.log_level,
                            access_log=False, timeout_keep_alive=300, lifespan="on",
                            **(tls.uvicorn_options() if tls else {}))
    # In a cluster the first SIGTERM drains before stopping (aenv.cluster.drain).
    uv = DrainingServer(config, srv.drain if srv.cluster is not None else None)
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
