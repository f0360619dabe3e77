"""Content codings of ``/files``: which one a download uses, which one an upload has.

gzip is the only coding besides identity. Negotiation follows RFC 7231 5.3.4 the way
upstream envd does it: the acceptable coding with the highest q wins (ties: first
listed), so the SDK's default ``Accept-Encoding: gzip, deflate`` gets gzip; identity is
acceptable unless ``identity;q=0`` or ``*;q=0`` rules it out, and if nothing acceptable
remains the answer is 406.
"""

from __future__ import annotations

import contextlib

from .errors import FilesHTTPError

GZIP = "gzip"
IDENTITY = "identity"
SUPPORTED = (GZIP,)


def _parse(header: str) -> tuple[list[tuple[str, float]], bool]:
    """[(coding, q)] in header order, and whether identity is ruled out."""
    codings: list[tuple[str, float]] = []
    for item in header.split(","):
        name, _, params = item.partition(";")
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.lower() == "q":
                with contextlib.suppress(ValueError):
                    q = float(value)
        codings.append((name.strip().lower(), q))
    identity_accepted = any(c == IDENTITY and q > 0 for c, q in codings)
    identity_rejected = any(c == IDENTITY and q == 0 for c, q in codings) or (
        any(c == "*" and q == 0 for c, q in codings) and not identity_accepted
    )
    return codings, identity_rejected


def identity_acceptable(accept_encoding: str | None) -> bool:
    return not accept_encoding or not _parse(accept_encoding)[1]


def negotiate(accept_encoding: str | None) -> str:
    """The coding to send a download in. Raises 406 when none is acceptable."""
    if not accept_encoding:
        return IDENTITY
    codings, identity_rejected = _parse(accept_encoding)
    for coding, q in sorted(codings, key=lambda cq: -cq[1]):
        if q <= 0:
            continue
        if coding == IDENTITY:
            return IDENTITY
        if coding == "*":
            return GZIP if identity_rejected else IDENTITY
        if coding in SUPPORTED:
            return coding
    if not identity_rejected:
        return IDENTITY
    raise FilesHTTPError(
        406, f"error parsing Accept-Encoding: no acceptable encoding found, supported: [{GZIP}]"
    )


def request_coding(content_encoding: str | None) -> str:
    """The coding of an upload body. Raises 400 for one we cannot decode."""
    if not content_encoding:
        return IDENTITY
    coding = content_encoding.partition(";")[0].strip().lower()
    if coding in (IDENTITY, *SUPPORTED):
        return coding
    raise FilesHTTPError(
        400,
        "error decompressing request body: unsupported Content-Encoding: "
        f"{content_encoding}, supported: [{GZIP}]",
    )
