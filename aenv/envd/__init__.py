"""envd: the daemon inside every sandbox, on port 49983.

It speaks the same wire protocol as E2B's envd (HTTP ``/health``, ``/init``, ``/files``,
``/envs``, ``/metrics`` and Connect-RPC ``process.Process`` and ``filesystem.Filesystem``)
so the E2B SDKs drive it unchanged. It imports nothing from the host side of aenv and
runs alone: ``python -m aenv.envd``.
"""
