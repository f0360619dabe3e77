"""Network slots for sandboxes: one netns per VM with a tap, a veth to the host, NAT and rules.

Every guest sees the same link (``guest_link``); the host reaches slot ``i`` at its own
address from ``Settings.host_cidr``, DNAT-ed to the guest inside the namespace, and the
guest's egress is SNAT-ed there and masqueraded on the host's way out. Guests reach neither
host services nor each other. ``SlotPool`` is what the orchestrator uses; ``NetworkSlot``
is what a runtime driver is handed (netns, tap name, host address);
``cleanup_leftovers`` runs once at start-up. The server's own connections to sandboxes
are made through ``access`` (marked sockets), so that with ``SlotPool(server_only=True)``
no other local process reaches a sandbox. Everything here needs root.
"""

from .access import SERVER_MARK, connect_socket, mark_socket, sandbox_transport
from .addressing import Addressing, SlotAddresses
from .cleanup import LeftoversReport, cleanup_leftovers
from .doctor import doctor_checks
from .errors import (
    HostTableError,
    NetnsError,
    NetworkError,
    NftError,
    PolicyError,
    PoolClosedError,
    PoolExhaustedError,
    SlotBusyError,
)
from .guest_link import GUEST_IP, GUEST_MAC, TAP_IP, TAP_MAC, TAP_NAME
from .netns import run_in as run_in_netns
from .policy import DEFAULT_POLICY, EgressPolicy
from .pool import SlotPool
from .slot import NetworkSlot

__all__ = [
    "DEFAULT_POLICY",
    "GUEST_IP",
    "GUEST_MAC",
    "SERVER_MARK",
    "TAP_IP",
    "TAP_MAC",
    "TAP_NAME",
    "Addressing",
    "EgressPolicy",
    "HostTableError",
    "LeftoversReport",
    "NetnsError",
    "NetworkError",
    "NetworkSlot",
    "NftError",
    "PolicyError",
    "PoolClosedError",
    "PoolExhaustedError",
    "SlotAddresses",
    "SlotBusyError",
    "SlotPool",
    "cleanup_leftovers",
    "connect_socket",
    "doctor_checks",
    "mark_socket",
    "run_in_netns",
    "sandbox_transport",
]
