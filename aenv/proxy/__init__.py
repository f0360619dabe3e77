"""Routing of sandbox traffic: envd and any other guest port, by header or host name.

The proxy streams bytes between the client and the sandbox's host-reachable address; it
knows routes, not VMs.
"""

from .router import ProxyRouter, Route, RouteTable, parse_host

__all__ = ["ProxyRouter", "Route", "RouteTable", "parse_host"]
