"""The node's egress proxy as ``aenv server`` runs it: the CA under ``<secrets>/egress-ca``,
secrets from the store (the node's, or a cluster's shared one), names resolved with
``AENV_EGRESS_HOSTS`` first, upstream TLS verified against the public CAs plus
``AENV_EGRESS_UPSTREAM_CA``, and never a connection to the host or aenv's own ranges
(``network.egress_guard``)."""

from __future__ import annotations

from ..config import Settings
from ..network.addressing import Addressing
from ..network.egress_guard import upstream_refused
from ..store.secrets import Secrets
from .ca import EgressCA
from .proxy import EgressProxy, Resolver


def node_proxy(settings: Settings, secrets: Secrets) -> EgressProxy:
    return EgressProxy(EgressCA(settings.secrets_dir / "egress-ca"), secrets.value,
                       resolver=Resolver(settings.egress_hosts),
                       refused=upstream_refused(Addressing(settings)),
                       upstream_ca=settings.egress_upstream_ca)
