"""Sandbox network options: what ``network`` at create and ``PUT /sandboxes/{id}/network``
may carry, and which of E2B's options this server refuses (spec part 2, section 3).

Every option is either honoured or refused with a 400 that names it — never accepted and
ignored (a create-only option in an update, too):

- ``allowOut``/``denyOut`` (IPv4 addresses, CIDRs, domain names and ``*.`` wildcards) and
  ``allow_internet_access`` are the egress policy (``aenv.network.policy``); an update
  replaces them atomically on the running sandbox, and they stay with it across
  pause/resume and fork. Names are enforced for HTTP and TLS by the node's egress proxy
  (``aenv.egress``); unlike E2B, ``denyOut`` takes names too.
- ``rules`` (header transforms, ``${e2b.secrets.<name>}`` placeholders) go to the same
  proxy; ``${e2b.identity.tokens.*}`` placeholders are refused (no workload identity).
- ``allowPublicTraffic`` (create only) makes user ports ask for the traffic token.
- ``dnsServers`` (IPv4, at most 10; left out: 8.8.8.8; ``[]``: none): when ``allowOut``
  names a domain, port 53 to them passes the firewall; a proxied sandbox's UDP queries to
  them are answered by the node (``aenv.egress.dns``). The guest's resolv.conf is not
  touched. Read back as given; an update without it resets it to the default.
- ``maskRequestHost`` (create only) is the Host header the proxy sends to user ports,
  ``${PORT}`` replaced by the port (envd's port is never masked).
- ``httpsPorts`` (create only): user ports whose service speaks TLS; the sandbox proxy
  re-encrypts to them without verifying the certificate (``aenv.proxy.router``). envd's
  port may not be listed.
- ``egressProxy`` (SOCKS5, ``aenv.egress.socks``): every TCP connection the rules allow
  goes through it, from the node; checked here (host:port, RFC 1929 lengths, ``tls``),
  read back without ``password`` and ``caCert`` (``views``), set or cleared by an update.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from fastapi import APIRouter, Request, Response

from ..egress.socks import SocksProxy
from ..envd import ENVD_PORT
from ..network.errors import PolicyError
from ..network.policy import MAX_DNS_SERVERS, EgressPolicy, header_rules
from .errors import ApiError
from .models import NetworkConfig, NetworkUpdate

router = APIRouter()

def _check_egress_proxy(options: dict[str, Any]) -> None:
    raw = options.get("egressProxy")
    if raw is None:
        return
    if not raw:  # an empty map asks for nothing
        del options["egressProxy"]
        return
    try:
        proxy = SocksProxy.from_option(raw)
    except ValueError as e:
        raise ApiError(400, f"network.egressProxy: {e}") from None
    # Kept as E2B's fields (the SDK drops unknown keys; so does this).
    kept = {k: raw[k] for k in ("address", "username", "password") if raw.get(k) is not None}
    if proxy.tls:
        kept["tls"] = {k: v for k, v in raw["tls"].items()
                       if k in ("enabled", "serverName", "caCert") and v is not None}
    options["egressProxy"] = kept


_HOST_VALUE = re.compile(r"^[A-Za-z0-9._:\[\]${}-]{1,255}$")


def _check_mask(value: str | None) -> None:
    if value is not None and not _HOST_VALUE.match(value):
        raise ApiError(400, "network.maskRequestHost must be a host name, optionally with "
                       "a port or ${PORT}")


def _check_dns(servers: list[str] | None) -> None:
    if servers is None:
        return
    if len(servers) > MAX_DNS_SERVERS:
        raise ApiError(400, f"network.dnsServers: at most {MAX_DNS_SERVERS} servers")
    for s in servers:
        try:
            ipaddress.IPv4Address(s)
        except ValueError:
            raise ApiError(400, f"network.dnsServers: '{s}' is not an IPv4 address") from None


def _check_https_ports(ports: list[int] | None) -> list[int] | None:
    """Valid ports, without repeats, envd's refused (its TLS is the proxy's business)."""
    if ports is None:
        return None
    out: list[int] = []
    for port in ports:
        if not 1 <= port <= 65535:
            raise ApiError(400, f"network.httpsPorts: {port} is not a port")
        if port == ENVD_PORT:
            raise ApiError(400, f"network.httpsPorts: {ENVD_PORT} (envd's port) may not "
                           "be listed")
        if port not in out:
            out.append(port)
    return out


def _check_policy(options: dict[str, Any]) -> None:
    """The allow/deny lists parse, before anything is made (a bad entry is the client's
    error, not a failed start)."""
    for key in ("allowOut", "denyOut"):
        for entry in options.get(key) or ():
            try:
                EgressPolicy.build(allow_out=[entry])
            except PolicyError:
                raise ApiError(400, f"network.{key}: '{entry}' is not an IPv4 address, "
                               "CIDR, domain name or *.wildcard") from None
    try:
        header_rules(options.get("rules"))
    except PolicyError as e:
        raise ApiError(400, f"network.rules: {e}") from None


def _checked(options: dict[str, Any], dns: list[str] | None) -> dict[str, Any]:
    _check_egress_proxy(options)
    _check_mask(options.get("maskRequestHost"))
    _check_dns(dns)
    _check_policy(options)
    if "httpsPorts" in options:
        options["httpsPorts"] = _check_https_ports(options["httpsPorts"])
    return options


def create_options(cfg: NetworkConfig | None) -> dict[str, Any] | None:
    """The ``network`` object of a create, checked; what the sandbox record keeps."""
    if cfg is None:
        return None
    return _checked(cfg.model_dump(exclude_none=True), cfg.dnsServers) or None


CREATE_ONLY = ("allowPublicTraffic", "maskRequestHost", "httpsPorts")


def update_options(body: NetworkUpdate) -> tuple[dict[str, Any], bool | None]:
    """(egress options, allow_internet) of an update; fields left out are cleared. The
    create-only options are refused by name (the SDKs never send them in an update)."""
    options = body.model_dump(exclude_none=True)
    given = [k for k in CREATE_ONLY if k in options]
    if given:
        raise ApiError(400, f"network.{given[0]} is set at create and cannot be updated")
    allow_internet = options.pop("allow_internet_access", None)
    return _checked(options, body.dnsServers), allow_internet


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(request: Request, sandbox_id: str, body: NetworkUpdate) -> Response:
    """Replace a running sandbox's egress rules at once (E2B: 204; 409 when paused)."""
    options, allow_internet = update_options(body)
    await request.app.state.orchestrator.update_network(sandbox_id, options, allow_internet)
    return Response(status_code=204)
