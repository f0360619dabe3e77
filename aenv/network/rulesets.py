"""nft rulesets of aenv as text: the host table and the table inside each slot namespace.

Pure functions, no side effects; ``nft.apply`` loads their output. The host table replaces
itself as a whole (``add`` + ``delete`` + definition in one transaction), so loading it
twice, or over a leftover of a crash, gives the same state. The slot table is loaded once,
into a namespace that was just created: it is a plain definition, because the delete in the
replace idiom costs about 10 ms of kernel synchronisation on every slot creation.

Host table ``inet <prefix>``: in prerouting, before any DNAT of the host's (Docker's
published ports, kube-proxy's node ports) can turn it into forwarded traffic, a new packet
from a slot veth to any address of the host itself (``fib daddr type local``: every
address of every interface, whenever it was added; broadcast and multicast too) is
refused, and so are the addresses of ``refused`` (the cloud metadata addresses, the
default gateways of the namespace aenv runs in, which are the outer host when that
namespace is a container's, and any address the caller names as the host's) and anything
but IPv4; input from any slot veth is dropped unless it is a
reply (the guest cannot reach host services); forwarding between two slot veths is
dropped (sandboxes cannot reach each other); forwarding into a slot veth is allowed only
for replies (nothing but the host itself opens connections to a sandbox); with
``server_mark``, the host's own packets to aenv's host range are refused unless their
socket carries that mark (only the server reaches a sandbox, see ``access``); guest
egress leaving through any other interface is masqueraded.

Slot table ``inet <prefix>`` inside the namespace: the host address is DNAT-ed to the guest,
the guest's egress is SNAT-ed to the host address (so the host routes replies back by its
/32 route and strict rp_filter holds), the namespace itself accepts nothing new, and
forwarding allows host->guest plus guest egress that passes ``EgressPolicy`` (aenv's ranges
and the metadata addresses refused first, see ``policy``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from .addressing import Addressing, SlotAddresses
from .guest_link import GUEST_IP, NS_VETH_NAME, TAP_IP, TAP_NAME
from .policy import METADATA_ADDRESSES, PRIVATE_RANGES, EgressPolicy

_REJECT = "reject with icmpx type admin-prohibited"
# Where a slot's egress listener (``aenv.egress``) waits, on the tap's own address: the
# guest's TCP 80 and 443 are redirected there when its policy ``needs_proxy`` (all its TCP
# when the policy has an ``upstream`` SOCKS proxy).
EGRESS_PORT = 15080
PROXIED_PORTS = (80, 443)
# and its UDP 53 to its ``dns_servers``, to the proxy's DNS on the same address
EGRESS_DNS_PORT = 15053
# The sandbox's own volume NFS server (``aenv.storage.volume_server``) on the tap address.
VOLUME_NFS_PORT = 2049


def _set(cidrs: Iterable[str]) -> str:
    nets = ipaddress.collapse_addresses(ipaddress.IPv4Network(c) for c in cidrs)
    return "{ " + ", ".join(str(n) for n in nets) + " }"


def _table(family: str, table: str, body: str) -> str:
    return f"table {family} {table} {{\n{body}}}\n"


def _replace(family: str, table: str, body: str) -> str:
    return f"add table {family} {table}\ndelete table {family} {table}\n" + \
        _table(family, table, body)


def host_table(a: Addressing, refused: Iterable[str] = (), server_mark: int | None = None) -> str:
    """``refused``: IPv4 addresses or CIDRs no guest may reach, on top of the host's own
    addresses and ``METADATA_ADDRESSES``. ``server_mark``: the only ``SO_MARK`` with
    which the host may open connections to aenv's host range (None: any)."""
    veths = f'"{a.veth_glob}"'
    output = "" if server_mark is None else f"""\
    chain output {{
        type filter hook output priority filter - 10; policy accept;
        ip daddr {a.host_net} meta mark != {server_mark:#x} ct state != related {_REJECT}
    }}
"""
    return _replace("inet", a.table, f"""\
    set refused {{
        type ipv4_addr; flags interval;
        elements = {_set([*METADATA_ADDRESSES, *refused])}
    }}
    chain prerouting {{
        type filter hook prerouting priority mangle - 10; policy accept;
        iifname {veths} meta nfproto != ipv4 drop
        iifname {veths} ct state established,related accept
        iifname {veths} fib daddr type {{ local, broadcast, multicast }} {_REJECT}
        iifname {veths} ip daddr @refused {_REJECT}
    }}
    chain input {{
        type filter hook input priority filter - 10; policy accept;
        iifname {veths} ct state established,related accept
        iifname {veths} drop
    }}
    chain forward {{
        type filter hook forward priority filter - 10; policy accept;
        iifname {veths} oifname {veths} drop
        oifname {veths} ct state established,related accept
        oifname {veths} drop
    }}
{output}    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {a.host_net} oifname != {veths} masquerade
    }}
""")


def _user_rules(policy: EgressPolicy) -> list[str]:
    rules = []
    if policy.dns_opened:  # before any deny: E2B opens them whatever else the lists say
        rules.append(f"ip daddr {_set(policy.dns_opened)} meta l4proto {{ tcp, udp }} "
                     "th dport 53 accept")
    if policy.allow_out:
        rules.append(f"ip daddr {_set(policy.allow_out)} accept")
    if policy.deny_out:
        rules.append(f"ip daddr {_set(policy.deny_out)} {_REJECT}")
    if not policy.allow_internet:
        rules.append(_REJECT)
    return rules


def slot_table(a: Addressing, s: SlotAddresses, policy: EgressPolicy) -> str:
    user = "".join(f"        {r}\n" for r in _user_rules(policy))
    return _table("inet", a.table, f"""\
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname "{NS_VETH_NAME}" ip daddr {s.host_ip} dnat ip to {GUEST_IP}
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{NS_VETH_NAME}" ip saddr {GUEST_IP} snat ip to {s.host_ip}
    }}
    chain input {{
        type filter hook input priority filter; policy drop;
        iif "lo" accept
        ct state established,related accept
        iifname "{TAP_NAME}" ip daddr {TAP_IP} tcp dport {EGRESS_PORT} ct status dnat accept
        iifname "{TAP_NAME}" ip daddr {TAP_IP} udp dport {EGRESS_DNS_PORT} ct status dnat accept
        iifname "{TAP_NAME}" ip daddr {TAP_IP} tcp dport {VOLUME_NFS_PORT} accept
    }}
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "{NS_VETH_NAME}" oifname "{TAP_NAME}" ip daddr {GUEST_IP} ct status dnat accept
        iifname "{TAP_NAME}" oifname "{NS_VETH_NAME}" ip saddr {GUEST_IP} jump egress
    }}
    chain egress {{
        ip daddr {_set([str(a.host_net), str(a.veth_net), *METADATA_ADDRESSES])} {_REJECT}
        jump egress_user
        ip daddr {_set(PRIVATE_RANGES)} {_REJECT}
        accept
    }}
    chain egress_user {{
{user}    }}
""")


def _redirect_rules(policy: EgressPolicy) -> list[str]:
    if not policy.needs_proxy:
        return []
    ports = ", ".join(str(p) for p in PROXIED_PORTS)
    if policy.upstream is not None:  # all of its TCP tunnels, but what the slot serves
        rules = [f'iifname "{TAP_NAME}" ip saddr {GUEST_IP} ip daddr != {TAP_IP} '
                 f"meta l4proto tcp redirect to :{EGRESS_PORT}"]
    else:
        rules = [f'iifname "{TAP_NAME}" ip saddr {GUEST_IP} tcp dport {{ {ports} }} '
                 f"redirect to :{EGRESS_PORT}"]
    if policy.dns_servers:  # the node answers the guest's resolvers (not other addresses)
        rules.append(f'iifname "{TAP_NAME}" ip saddr {GUEST_IP} '
                     f"ip daddr {_set(policy.dns_servers)} udp dport 53 "
                     f"redirect to :{EGRESS_DNS_PORT}")
    return rules


def policy_update(a: Addressing, policy: EgressPolicy) -> str:
    """Replace only the user part of a slot's egress rules (one transaction): the CIDR
    rules, and the redirect of HTTP(S) to the egress listener (its own nat chain, made
    on first use)."""
    lines = [f"flush chain inet {a.table} egress_user"]
    lines += [f"add rule inet {a.table} egress_user {r}" for r in _user_rules(policy)]
    lines.append(f"add chain inet {a.table} egress_redirect "
                 "{ type nat hook prerouting priority dstnat - 5; policy accept; }")
    lines.append(f"flush chain inet {a.table} egress_redirect")
    lines += [f"add rule inet {a.table} egress_redirect {r}" for r in _redirect_rules(policy)]
    return "\n".join(lines) + "\n"


def delete_table(family: str, name: str) -> str:
    return f"delete table {family} {name}\n"
