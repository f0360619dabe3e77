"""The one place that runs ``nft``.

Rulesets go in as text on stdin of a single ``nft -f -``: nft applies the whole input as
one kernel transaction, so a slot's rules (or a policy change) land completely or not at
all. ``netns`` runs nft inside a named namespace: the child inherits the namespace of the
thread that spawns it (see ``netns.run_in``), so no ``ip netns exec`` is needed.
"""

from __future__ import annotations

import json
import shutil
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
