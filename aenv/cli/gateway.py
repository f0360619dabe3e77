"""``aenv gateway``: serve one cluster's nodes behind one URL (``aenv.cluster.gateway``).

Reads the same settings as ``aenv server`` where they apply: ``--host``/``--port``
(``AENV_LISTEN_HOST``/``AENV_LISTEN_PORT``), ``--cluster`` (``AENV_CLUSTER``, required),
``AENV_CLUSTER_SECRET`` (required: what nodes let the gateway in with) and the API key
clients must send (``AENV_API_KEY``, else ``$AENV_HOME/secrets/api-key``, as a server),
and TLS as a server takes it (``--tls-cert``/``--tls-key``, or ``--tls-self-signed`` for
``--domain``'s local CA under ``$AENV_HOME/secrets/tls``). No root needed, nothing kept on
disk besides that key file (and the local CA's files).
"""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from ..config import SettingsError
from .serving import ListenError, flag, listen, run, server_settings


def register(app: typer.Typer) -> None:
    app.command()(gateway)


def gateway(
    host: str | None = flag("listen_host"),
    port: int | None = flag("listen_port"),
    cluster: str | None = flag("cluster"),
    domain: str | None = flag("domain"),
    tls_cert: Path | None = flag("tls_cert", dir_okay=False),
    tls_key: Path | None = flag("tls_key", dir_okay=False),
    tls_self_signed: bool | None = flag("tls_self_signed"),
    log_level: str | None = flag("log_level"),
) -> None:
    """Serve the E2B API and sandbox traffic of a cluster's nodes on one listener."""
    import uvicorn

    from ..api.auth import ApiKeyError, load_api_key
    from ..cluster.gateway import Gateway
    from ..cluster.registry import Registry
    from ..tls import TlsError, listener_tls

    try:
        s = server_settings({"listen_host": host, "listen_port": port, "cluster": cluster,
                             "domain": domain, "tls_cert": tls_cert, "tls_key": tls_key,
                             "tls_self_signed": tls_self_signed,
                             "log_level": log_level and log_level.lower()})
        if not s.cluster:
            raise SettingsError("--cluster / AENV_CLUSTER (redis://HOST:PORT/DB) is required")
        if not s.cluster_secret:
            raise SettingsError("AENV_CLUSTER_SECRET is required (the nodes' one)")
        api_key, key_file = load_api_key(s.secrets_dir, s.api_key)
        tls = listener_tls(s.secrets_dir, s.domain, cert=s.tls_cert, key=s.tls_key,
                           self_signed=s.tls_self_signed)
        sock = listen(s.listen_host, s.listen_port)
    except (SettingsError, ApiKeyError, ListenError, TlsError) as e:
        typer.echo(f"aenv gateway: {e}", err=True)
        raise typer.Exit(1) from None
    logging.basicConfig(level=s.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    gw = Gateway(Registry.from_url(s.cluster), api_key=api_key, cluster_secret=s.cluster_secret)
    logging.getLogger("aenv.gateway").info(
        "gateway on %s://%s:%d for %s; API key %s", "https" if tls else "http",
        s.listen_host, s.listen_port, s.cluster.split("@")[-1],
        key_file or "from AENV_API_KEY")
    if tls is not None and tls.ca is not None:
        typer.echo(f"aenv gateway: TLS from the local CA {tls.ca}; clients trust it with "
                   f"SSL_CERT_FILE={tls.ca} (Python) or NODE_EXTRA_CA_CERTS={tls.ca} (Node)",
                   err=True)
    uv = uvicorn.Server(uvicorn.Config(gw.app, log_level=s.log_level, access_log=False,
                                       timeout_keep_alive=300, lifespan="on",
                                       **(tls.uvicorn_options() if tls else {})))
    run(uv, sock)
