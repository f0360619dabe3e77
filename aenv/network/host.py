"""Host-wide networking state that all slots share: IPv4 forwarding and aenv's host table.

``prepare`` is idempotent and run before the first slot is made. It turns on
``net.ipv4.ip_forward`` (a host-wide switch that aenv never turns back off: other software
may rely on it once on) and (re)loads the host table of ``rulesets.host_table``, which
matches slot veths by name pattern, so adding a slot needs no host rule change.
"""

from __future__ import annotations

from . import netns as _netns
from . import nft, rulesets
from .addressing import Addressing

_IP_FORWARD = "/proc/sys/net/ipv4/ip_forward"


def ip_forward_enabled() -> bool:
    with open(_IP_FORWARD) as f:
        return f.read().strip() == "1"


def prepare(addressing: Addressing) -> None:
    if not ip_forward_enabled():
        _netns.sysctl("net.ipv4.ip_forward", 1)
    nft.apply(rulesets.host_table(addressing))


def remove_table(addressing: Addressing) -> bool:
    """Delete aenv's host table; False if it was not there."""
    if ("inet", addressing.table) not in nft.list_tables():
        return False
    nft.apply(rulesets.delete_table("inet", addressing.table))
    return True
