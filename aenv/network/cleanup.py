"""Start-up clean-up: remove what a crashed aenv left on the host, and nothing else.

What belongs to aenv is recognised by name alone (see ``Addressing``): namespaces
``<prefix>-ns-<i>``, host veths ``<prefix>-v<i>``, nft tables named ``<prefix>`` or
``<prefix>-…``. Processes are aenv's when their network namespace is one of those namespaces
(``/proc/<pid>/ns/net`` and ``/run/netns/<name>`` are the same nsfs inode); they are the
VMMs of the lost sandboxes and get SIGTERM, then SIGKILL. Slots whose index is in ``keep``
(sandboxes the store says are still running, to be re-attached) are left entirely alone,
and so is the host table while any slot is kept.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from ..config import Settings
from . import conntrack, nft, rulesets
from . import netns as _netns
from .addressing import Addressing

log = logging.getLogger("aenv.network")

_TERM_GRACE = 2.0
_KILL_GRACE = 2.0


@dataclass
class LeftoversReport:
    """What ``cleanup_leftovers`` removed (for the start-up log)."""

    killed_pids: list[int] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    veths: list[str] = field(default_factory=list)
    nft_tables: list[str] = field(default_factory=list)
    conntrack_entries: int = 0
    kept: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.killed_pids or self.namespaces or self.veths or self.nft_tables
                    or self.conntrack_entries)

    def summary(self) -> str:
        return (f"killed={self.killed_pids} netns={self.namespaces} veths={self.veths} "
                f"nft_tables={self.nft_tables} conntrack={self.conntrack_entries} "
                f"kept={self.kept}")


def _alive(pid: int) -> bool:
    """False once the process is gone or a zombie (a zombie holds no namespace)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _kill(pids: list[int]) -> None:
    for sig, grace in ((signal.SIGTERM, _TERM_GRACE), (signal.SIGKILL, _KILL_GRACE)):
        living = [p for p in pids if _alive(p)]
        for pid in living:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while living and time.monotonic() < deadline:
            time.sleep(0.02)
            living = [p for p in living if _alive(p)]
        if not living:
            return
    log.warning("processes survived SIGKILL: %s", [p for p in pids if _alive(p)])


def cleanup_leftovers(settings: Settings, keep: Iterable[int] = ()) -> LeftoversReport:
    a = Addressing(settings)
    kept = sorted(set(keep))
    report = LeftoversReport(kept=kept)

    def ours(index: int | None) -> bool:
        return index is not None and index not in kept

    names = [n for n in _netns.list_names() if ours(a.index_of_netns(n))]
    me = os.getpid()
    pids = sorted(p for found in _netns.pids_in(names).values() for p in found if p != me)
    if pids:
        _kill(pids)
        report.killed_pids = pids

    with IPRoute() as ipr:
        for link in ipr.get_links():
            name = link.get_attr("IFLA_IFNAME")
            if ours(a.index_of_veth(name)):
                try:
                    ipr.link("del", index=link["index"])
                    report.veths.append(name)
                except NetlinkError as e:
                    log.warning("leftover veth %s: %s", name, e)

    for name in names:
        if _netns.remove(name):
            report.namespaces.append(name)

    for family, table in nft.list_tables():
        if not a.owns_table(table):
            continue
        if kept and (family, table) == ("inet", a.table):
            continue  # the kept slots still need it; SlotPool.start reloads it anyway
        nft.apply(rulesets.delete_table(family, table))
        report.nft_tables.append(f"{family} {table}")

    report.conntrack_entries = conntrack.flush_sources_in(
        str(a.host_net), keep=[a.slot(i).host_ip for i in kept if 1 <= i <= a.capacity])
    if report:
        log.info("removed network leftovers: %s", report.summary())
    return report
