"""envd: the daemon inside every sandbox, on port 49983 (``ENVD_PORT``).

It speaks the same wire protocol as E2B's envd (HTTP ``/health``, ``/init``, ``/files``,
``/envs``, ``/metrics`` and Connect-RPC ``process.Process`` and ``filesystem.Filesystem``)
so the E2B SDKs drive it unchanged. It imports nothing from the host side of aenv and
runs alone: ``python -m aenv.envd``.

``ENVD_PORT`` is defined here once, for envd and for the host side (the envd client, the
proxy, template builds), which may import this package: it imports nothing itself. The
port is part of every guest's fixed identity (see ``aenv.network.guest_link``) and of the
SDKs' sandbox URLs (``https://49983-<id>.<domain>``); it never changes.
"""

ENVD_PORT = 49983
