"""The guest's DNS, answered by the node when the guest's policy names domains: the slot
redirects the guest's UDP 53 here, so what a name resolves to agrees with what the proxy
lets through. A name the policy refuses is NXDOMAIN; an allowed name gets the IPv4
addresses the node resolves it to (those the proxy would dial: ``EgressProxy.addresses``),
as A records with a short TTL; other types (AAAA: guests are IPv4 only) get no records.
TCP DNS is not redirected: it stays under the CIDR rules.

Only the wire format's fixed parts are needed (RFC 1035: a header, one question, answers
that point back at the question's name), so it is parsed here rather than with a DNS
library.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Sequence
from dataclasses import dataclass

TYPE_A = 1
CLASS_IN = 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
TTL = 30


class BadQuery(Exception):
    pass


@dataclass(frozen=True)
class Query:
    id: int
    flags: int
    name: str
    qtype: int
    qclass: int
    question: bytes  # as sent, echoed in the answer


def parse(data: bytes) -> Query:
    """The one question of a standard query; raises BadQuery."""
    if len(data) < 12:
        raise BadQuery("short header")
    qid, flags, qdcount = struct.unpack("!HHH", data[:6])
    if flags & 0x8000 or (flags >> 11) & 0xF != 0 or qdcount != 1:
        raise BadQuery("not one standard query")
    labels, p = [], 12
    while True:
        if p >= len(data):
            raise BadQuery("name runs past the message")
        n = data[p]
        if n == 0:
            p += 1
            break
        if n & 0xC0:
            raise BadQuery("compressed name in a question")
        label = data[p + 1:p + 1 + n]
        if len(label) != n:
            raise BadQuery("label runs past the message")
        labels.append(label.decode("ascii", "replace").lower())
        p += 1 + n
    if p + 4 > len(data):
        raise BadQuery("no type and class")
    qtype, qclass = struct.unpack("!HH", data[p:p + 4])
    return Query(qid, flags, ".".join(labels), qtype, qclass, data[12:p + 4])


def answer(q: Query, rcode: int, addresses: Sequence[str] = ()) -> bytes:
    """The response to ``q``: ``rcode`` and, for an A question, ``addresses``."""
    records = [a for a in addresses if q.qtype == TYPE_A and q.qclass == CLASS_IN]
    flags = 0x8000 | (q.flags & 0x0100) | 0x0080 | rcode  # QR, RD copied, RA
    out = struct.pack("!HHHHHH", q.id, flags, 1, len(records), 0, 0) + q.question
    for a in records:
        out += struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, TTL, 4)
        out += ipaddress.IPv4Address(a).packed
    return out


def error(data: bytes, rcode: int) -> bytes | None:
    """A bare error answer to an unparsable message (None: not even a header)."""
    if len(data) < 12:
        return None
    qid, flags = struct.unpack("!HH", data[:4])
    return struct.pack("!HHHHHH", qid, 0x8000 | (flags & 0x0100) | rcode, 0, 0, 0, 0)
