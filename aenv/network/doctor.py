"""Rows for ``aenv doctor`` about host networking: what slots need and whether it is here."""

from __future__ import annotations

import os

from . import host, nft
from .errors import NftError


def doctor_checks() -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    exe = nft.binary()
    if exe is None:
        rows.append(("nftables", "missing: install the nftables package"))
    else:
        try:
            rows.append(("nftables", f"{nft.version()} ({exe})"))
        except NftError as e:
            rows.append(("nftables", f"{exe} does not run: {e}"))
    try:
        on = host.ip_forward_enabled()
        rows.append(("ip_forward", "on" if on else "off (aenv turns it on when it starts)"))
    except OSError as e:
        rows.append(("ip_forward", f"unknown: {e}"))
    rows.append(("/dev/net/tun", "present" if os.path.exists("/dev/net/tun")
                 else "missing: no taps, no sandboxes"))
    rows.append(("network privileges", "root" if os.geteuid() == 0
                 else "not root: network slots need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"))
    return rows
