"""Errors raised by ``aenv.network``.

Every failure of a host networking operation is a ``NetworkError``; the subclasses say
which part failed and carry what a caller needs to act on it (the netns, the ruleset, the
slot index).
"""

from __future__ import annotations


class NetworkError(Exception):
    """Base of every error raised by aenv.network."""


class NetnsError(NetworkError):
    """A network namespace could not be created, entered or removed."""


class NftError(NetworkError):
    """``nft`` refused a ruleset. ``stderr`` is nft's own explanation, ``ruleset`` the input."""

    def __init__(self, message: str, *, stderr: str = "", ruleset: str = "") -> None:
        super().__init__(f"{message}: {stderr.strip()}" if stderr else message)
        self.stderr = stderr
        self.ruleset = ruleset


class PolicyError(NetworkError, ValueError):
    """An egress policy entry is not an IPv4 address or CIDR (``entry`` names it)."""

    def __init__(self, entry: str, reason: str) -> None:
        super().__init__(f"invalid egress entry {entry!r}: {reason}")
        self.entry = entry


class SlotBusyError(NetworkError):
    """The slot's tap is still held by a process (a VMM was not stopped before release)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"network slot {index}: tap still attached to a process")
        self.index = index


class PoolExhaustedError(NetworkError):
    """Every slot index the configured address ranges allow is in use."""


class PoolClosedError(NetworkError):
    """The pool was closed; it hands out no more slots."""


class HostTableError(NetworkError):
    """aenv's host nft table (``table``) was removed or changed behind its back (an ``nft
    flush ruleset``, a firewall reload) and could not be loaded again: guests are not
    isolated from the host, so no slot is handed out until it is back. The cause is
    chained (``__cause__``, usually an ``NftError`` with nft's own explanation)."""

    def __init__(self, table: str, cause: BaseException) -> None:
        super().__init__(
            f"aenv's host nft table 'inet {table}' is missing or was changed, and restoring "
            f"it failed ({cause}); no network slot is handed out until it is restored (did "
            f"something flush the host's nftables ruleset?)")
        self.table = table
