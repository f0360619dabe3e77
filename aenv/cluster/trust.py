"""The cluster secret: what a gateway's calls to a node carry instead of a client's key.

A gateway authenticates clients with its API key, then calls nodes with
``X-Aenv-Cluster-Secret: <AENV_CLUSTER_SECRET>``. A node in a cluster accepts that header
in place of its own API key (``aenv.api.auth.ApiKeyMiddleware``), treats a request with it
as a REST call (``aenv.proxy.front``), and never forwards it into a sandbox
(``aenv.proxy.router``). A gateway drops any such header a client sends, so only holders of
the secret (gateways, operators) can use it.
"""

from __future__ import annotations

SECRET_HEADER = b"x-aenv-cluster-secret"
