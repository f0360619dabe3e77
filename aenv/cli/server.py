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

import logging
import os
from pathlib import Path

import typer

from ..config import SettingsError
from .serving import ListenError, flag, listen, run, server_settings


def register(app: typer.Typer) -> None:
    app.command()(server)


def server(
    host: str | None = flag("listen_host"),
    port: int | None = flag("listen_port"),
    domain: str | None = flag("domain"),
    max_sandboxes: int | None = flag("max_sandboxes"),
    max_starting: int | None = flag("max_starting"),
    max_fork: int | None = flag("max_fork"),
    log_level: str | None = flag("log_level"),
    snapshot_base: bool | None = flag("snapshot_base"),
    tls_cert: Path | None = flag("tls_cert", dir_okay=False),
    tls_key: Path | None = flag("tls_key", dir_okay=False),
    tls_self_signed: bool | None = flag("tls_self_signed"),
    cluster: str | None = flag("cluster"),
    node_id: str | None = flag("node_id"),
    advertise: str | None = flag("advertise_url"),
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
        sock = listen(s.listen_host, s.listen_port)
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
    run(uv, sock, then=lock.release)
