"""The link every guest sees, identical in every sandbox (part of the snapshot ABI).

The guest's eth0 is ``GUEST_IP``/30 with gateway ``TAP_IP`` on ``TAP_NAME`` inside the
sandbox's own network namespace. Both MAC addresses are fixed too: the guest's neighbour
cache holds the gateway's MAC across a snapshot, and the namespace holds a permanent
neighbour entry for the guest's, so a VM restored into any slot talks at once with no ARP.
Runtime drivers must give the guest NIC ``GUEST_MAC``; nothing here may change once
snapshots exist. envd listens on ``GUEST_IP`` at ``aenv.envd.ENVD_PORT`` (defined with envd,
which must run without the host side).
"""

from __future__ import annotations

GUEST_IP = "169.254.0.21"
TAP_IP = "169.254.0.22"
LINK_PREFIXLEN = 30
GUEST_MAC = "02:fc:00:00:00:05"
TAP_MAC = "02:fc:00:00:00:06"
TAP_NAME = "tap0"
# The namespace end of the veth pair that leads to the host.
NS_VETH_NAME = "eth0"
