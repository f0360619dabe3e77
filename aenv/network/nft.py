"""The one place that runs ``nft``.

Rulesets go in as text on stdin of a single ``nft -f -``: nft applies the whole input as
one kernel transaction, so a slot's rules (or a policy change) land completely or not at
all. ``netns`` runs nft inside a named namespace: the child inherits the namespace of the
thread that spawns it (see ``netns.run_in``), so no ``ip netns exec`` is needed.

``generation`` is the exception that spawns nothing: one netlink request for the ruleset's
generation number, which the kernel bumps on every committed change in the namespace, so
"has anything changed since?" costs microseconds instead of a listing.
"""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess

from . import netns as _netns
from .errors import NftError

_TIMEOUT = 30.0


def binary() -> str | None:
    """Path of the nft command, also where PATH lacks /usr/sbin (non-login root shells)."""
    return shutil.which("nft") or shutil.which("nft", path="/usr/sbin:/sbin")


def _run(args: list[str], stdin: str | None, netns: str | None) -> str:
    exe = binary()
    if exe is None:
        raise NftError("nft not found (install the nftables package)")

    def call() -> subprocess.CompletedProcess[str]:
        return subprocess.run([exe, *args], input=stdin, capture_output=True, text=True,
                              timeout=_TIMEOUT, check=False)

    proc = call() if netns is None else _netns.run_in(netns, call)
    if proc.returncode != 0:
        where = f" in netns {netns}" if netns else ""
        raise NftError(f"nft {' '.join(args)}{where} failed", stderr=proc.stderr,
                       ruleset=stdin or "")
    return proc.stdout


def apply(ruleset: str, *, netns: str | None = None) -> None:
    """Apply ``ruleset`` atomically (one ``nft -f -`` transaction) in ``netns``, or with
    ``netns=None`` in the calling thread's namespace (the host, or the namespace a
    ``netns.create``/``run_in`` callback runs in)."""
    _run(["-f", "-"], ruleset, netns)


def list_tables(*, netns: str | None = None) -> list[tuple[str, str]]:
    """Every nft table as ``(family, name)``."""
    out = json.loads(_run(["-j", "list", "tables"], None, netns) or "{}")
    return [(item["table"]["family"], item["table"]["name"])
            for item in out.get("nftables", []) if "table" in item]


def list_table(family: str, name: str, *, netns: str | None = None) -> str:
    """One table as nft prints it (for logs, doctor output and tests)."""
    return _run(["list", "table", family, name], None, netns)


def version() -> str:
    return _run(["--version"], None, None).strip()


_NETLINK_NETFILTER = 12
_NFT_MSG_NEWGEN = (10 << 8) | 15  # NFNL_SUBSYS_NFTABLES, NFT_MSG_NEWGEN: the answer
_NFT_MSG_GETGEN = (10 << 8) | 16  # and the question
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NFTA_GEN_ID = 1


def generation() -> int | None:
    """The nft ruleset generation of the calling thread's namespace; None if the kernel
    does not answer (then every check has to list)."""
    request = struct.pack("=IHHII", 20, _NFT_MSG_GETGEN, _NLM_F_REQUEST, 1, 0) + \
        struct.pack("=BBH", socket.AF_UNSPEC, 0, 0)  # nfgenmsg: family, version, res_id
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                           _NETLINK_NETFILTER) as s:
            s.settimeout(1.0)
            s.bind((0, 0))
            s.send(request)
            data = s.recv(4096)
    except OSError:
        return None
    if len(data) < 20:
        return None
    length, kind = struct.unpack_from("=IH", data)
    if kind != _NFT_MSG_NEWGEN:  # an error answer, or something unexpected
        return None
    offset = 20  # nlmsghdr (16) + nfgenmsg (4)
    while offset + 4 <= min(length, len(data)):
        alen, atype = struct.unpack_from("=HH", data, offset)
        if alen < 4:
            break
        if atype & 0x3FFF == _NFTA_GEN_ID and alen >= 8:
            gen_id: int = struct.unpack_from(">I", data, offset + 4)[0]
            return gen_id
        offset += (alen + 3) & ~3
    return None
