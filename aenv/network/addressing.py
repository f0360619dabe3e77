"""Names and addresses of network slot ``i``, derived from ``Settings`` alone.

Slot ``i`` (1 <= i <= capacity) gets the netns ``<prefix>-ns-<i>``, the host-side veth
``<prefix>-v<i>``, the host-reachable address ``host_cidr[i]`` and the veth /31
``veth_cidr[2i]`` (host end) / ``veth_cidr[2i+1]`` (namespace end). Index 0 is never used,
so no slot owns a network address of either range. Pure arithmetic: the same settings
always give the same names, which is how leftovers of a crash are recognised.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from ..config import Settings

IFNAMSIZ = 15  # usable characters of a Linux interface name


@dataclass(frozen=True)
class SlotAddresses:
    index: int
    netns: str
    host_veth: str
    host_ip: str
    veth_host_ip: str
    veth_ns_ip: str


class Addressing:
    """Maps slot indices to names and addresses for one ``Settings``."""

    def __init__(self, settings: Settings) -> None:
        self.prefix = settings.name_prefix
        self.host_net = ipaddress.IPv4Network(settings.host_cidr)
        self.veth_net = ipaddress.IPv4Network(settings.veth_cidr)
        if self.host_net.overlaps(self.veth_net):
            raise ValueError(f"host_cidr {self.host_net} overlaps veth_cidr {self.veth_net}")
        # Leave out index 0 and the last host address (the range's broadcast address).
        self.capacity = min(self.host_net.num_addresses - 2, self.veth_net.num_addresses // 2 - 1)
        if self.capacity < 1:
            raise ValueError(f"{self.host_net} / {self.veth_net} leave room for no slot")
        if not re.fullmatch(r"[a-z][a-z0-9]*", self.prefix):
            raise ValueError(f"name_prefix {self.prefix!r}: use lower-case letters and digits")
        longest = len(f"{self.prefix}-v{self.capacity}")
        if longest > IFNAMSIZ:
            raise ValueError(
                f"name_prefix {self.prefix!r} too long: {self.prefix}-v{self.capacity} has "
                f"{longest} characters, interface names allow {IFNAMSIZ}"
            )
        self._netns_re = re.compile(rf"{re.escape(self.prefix)}-ns-([1-9][0-9]*)")
        self._veth_re = re.compile(rf"{re.escape(self.prefix)}-v([1-9][0-9]*)")

    @property
    def table(self) -> str:
        """Name of aenv's nft table, on the host and inside every slot namespace."""
        return self.prefix

    @property
    def veth_glob(self) -> str:
        """nft interface-name pattern matching every slot's host-side veth."""
        return f"{self.prefix}-v*"

    def slot(self, index: int) -> SlotAddresses:
        if not 1 <= index <= self.capacity:
            raise ValueError(f"slot index {index} outside 1..{self.capacity}")
        return SlotAddresses(
            index=index,
            netns=f"{self.prefix}-ns-{index}",
            host_veth=f"{self.prefix}-v{index}",
            host_ip=str(self.host_net[index]),
            veth_host_ip=str(self.veth_net[2 * index]),
            veth_ns_ip=str(self.veth_net[2 * index + 1]),
        )

    def index_of_netns(self, name: str) -> int | None:
        """The slot index if ``name`` is one of our namespaces, else None."""
        m = self._netns_re.fullmatch(name)
        return int(m.group(1)) if m else None

    def index_of_veth(self, name: str) -> int | None:
        """The slot index if ``name`` is one of our host-side veths, else None."""
        m = self._veth_re.fullmatch(name)
        return int(m.group(1)) if m else None

    def owns_table(self, name: str) -> bool:
        """True for nft tables aenv creates with this prefix (and for nothing else)."""
        return name == self.prefix or name.startswith(self.prefix + "-")
