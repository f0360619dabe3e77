"""The node's egress proxy as ``aenv server`` runs it: the CA under ``<secrets>/egress-ca``,
secrets from the store (the node's, or a cluster's shared one), names resolved with
``AENV_EGRESS_HOSTS`` first, upstream TLS verified against the public CAs plus
``AENV_EGRESS_UPSTREAM_CA``, and never a connection to the host or aenv's own ranges
(``network.egress_guard``). A sandbox's own SOCKS proxy (``egressProxy``) is not dialled
in private or internal ranges either, as E2B refuses them, unless
``AENV_EGRESS_PROXY_NETWORKS`` lists them."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from ..config import Settings
from ..network.addressing import Addressing
from ..network.egress_guard import upstream_refused
from ..network.policy import METADATA_ADDRESSES, PRIVATE_RANGES
from ..store.secrets import Secrets
from .ca import EgressCA
from .proxy import EgressProxy, Resolver


def node_proxy(settings: Settings, secrets: Secrets) -> EgressProxy:
    refused = upstream_refused(Addressing(settings))
    return EgressProxy(EgressCA(settings.secrets_dir / "egress-ca"), secrets.value,
                       resolver=Resolver(settings.egress_hosts), refused=refused,
                       upstream_ca=settings.egress_upstream_ca,
                       proxy_refused=proxy_address_refused(
                           refused, settings.egress_proxy_networks))


def proxy_address_refused(refused: Callable[[str], bool], networks: str | None
                          ) -> Callable[[str], bool]:
    """Where a sandbox's SOCKS proxy may not be: what ``refused`` says, and private or
    internal ranges (``PRIVATE_RANGES``, metadata) unless ``networks`` (comma-separated
    CIDRs) lists them."""
    allowed = [ipaddress.IPv4Network(n.strip()) for n in (networks or "").split(",")
               if n.strip()]
    internal = [ipaddress.IPv4Network(n) for n in (*PRIVATE_RANGES, *METADATA_ADDRESSES)]

    def check(address: str) -> bool:
        if refused(address):
            return True
        ip = ipaddress.IPv4Address(address)
        return any(ip in n for n in internal) and not any(ip in n for n in allowed)
    return check
