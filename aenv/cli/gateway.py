"""``aenv gateway``: serve one cluster's nodes behind one URL (``aenv.cluster.gateway``).

Reads the same settings as ``aenv server`` where they apply: ``--host``/``--port``
(``AENV_LISTEN_HOST``/``AENV_LISTEN_PORT``), ``--cluster`` (``AENV_CLUSTER``, required),
``AENV_CLUSTER_SECRET`` (required: what nodes let the gateway in with) and the API key
clients must send (``AENV_API_KEY``, else ``$AENV_HOME/secrets/api-key``, as a server).
No root needed, nothing kept on disk besides that key file.
"""

from __future__ import annotations

import logging

import typer

from ..config import SettingsError
from .serving import ListenError, flag, listen, run, server_settings


def register(app: typer.Typer) -> None:
    app.command()(gateway)


def gateway(
    host: str | None = flag("listen_host"),
    port: int | None = flag("listen_port"),
    cluster: str | None = flag("cluster"),
    log_level: str | None = flag("log_level"),
) -> None:
    """Serve the E2B API and sandbox traffic of a cluster's nodes on one listener."""
    import uvicorn

    from ..api.auth import ApiKeyError, load_api_key
    from ..cluster.gateway import Gateway
    from ..cluster.registry import Registry

    try:
        s = server_settings({"listen_host": host, "listen_port": port, "cluster": cluster,
                             "log_level": log_level and log_level.lower()})
        if not s.cluster:
            raise SettingsError("--cluster / AENV_CLUSTER (redis://HOST:PORT/DB) is required")
        if not s.cluster_secret:
            raise SettingsError("AENV_CLUSTER_SECRET is required (the nodes' one)")
        api_key, key_file = load_api_key(s.secrets_dir, s.api_key)
        sock = listen(s.listen_host, s.listen_port)
    except (SettingsError, ApiKeyError, ListenError) as e:
        typer.echo(f"aenv gateway: {e}", err=True)
        raise typer.Exit(1) from None
    logging.basicConfig(level=s.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    gw = Gateway(Registry.from_url(s.cluster), api_key=api_key, cluster_secret=s.cluster_secret)
    logging.getLogger("aenv.gateway").info(
        "gateway on %s:%d for %s; API key %s", s.listen_host, s.listen_port,
        s.cluster.split("@")[-1], key_file or "from AENV_API_KEY")
    uv = uvicorn.Server(uvicorn.Config(gw.app, log_level=s.log_level, access_log=False,
                                       timeout_keep_alive=300, lifespan="on"))
    run(uv, sock)
