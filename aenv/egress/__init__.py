"""The node's egress proxy: HTTP (Host) and TLS (SNI) connections of guests whose policy
names domains or header transforms (``aenv.network.policy.EgressPolicy.needs_proxy``).

``sniff`` reads the name a connection is for, ``ca`` is the node's interception CA and
its leaf certificates, ``proxy`` serves the listeners the slots hand it (``attach``) and
applies each slot's current policy to every new connection, ``socks`` tunnels what a
policy with an upstream proxy (``egressProxy``) allows through that SOCKS5 proxy.
"""
