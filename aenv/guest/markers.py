"""Boot-phase markers printed on the guest console, and a parser for them.

Format (one line each): ``aenv-initrd: <phase> <uptime>`` from the cloud kernel's initramfs
and ``aenv-init: <phase> <uptime> [key=value ...]`` from the image's init, with the guest's
``/proc/uptime`` in seconds. Phases in boot order are listed in ``PHASES``; ``envd-fork``
and ``envd-exit`` repeat each time the server is re-forked or exits, ``envd-exec`` and
``launcher-exit`` each time the launcher itself is restarted or exits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PHASES = (
    "aenv-initrd:start",
    "aenv-initrd:modules-loaded",
    "aenv-initrd:network",
    "aenv-initrd:switch-root",
    "aenv-init:start",
    "aenv-init:mounted",
    "aenv-init:network",
    "aenv-init:envd-exec",
    "aenv-init:envd-imported",
    "aenv-init:envd-fork",
)

_LINE = re.compile(r"(aenv-initrd|aenv-init): ([a-z-]+) (\d+(?:\.\d+)?)((?: \w+=\S*)*)\s*$")


@dataclass(frozen=True)
class Marker:
    source: str  # "aenv-initrd" or "aenv-init"
    phase: str
    uptime: float
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.source}:{self.phase}"


def parse(console: str) -> list[Marker]:
    """Every marker in ``console`` text, in order (kernel log lines in between are skipped)."""
    found = []
    for line in console.splitlines():
        m = _LINE.search(line.replace("\r", ""))
        if m:
            extra = dict(kv.split("=", 1) for kv in m.group(4).split())
            found.append(Marker(m.group(1), m.group(2), float(m.group(3)), extra))
    return found


def first_times(console: str) -> dict[str, float]:
    """Guest uptime of the first occurrence of each phase, keyed ``source:phase``."""
    out: dict[str, float] = {}
    for marker in parse(console):
        out.setdefault(marker.key, marker.uptime)
    return out
