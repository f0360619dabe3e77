"""The DNS wire format of ``aenv.egress.dns``: queries as resolvers send them, answers a
resolver accepts (checked by decoding them back field by field)."""

from __future__ import annotations

import struct

import pytest

from aenv.egress import dns


def query(name: str, qtype: int = dns.TYPE_A, qid: int = 0x1234) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + \
        struct.pack("!HH", qtype, dns.CLASS_IN)


def test_a_query_parses_and_its_answer_carries_a_records() -> None:
    q = dns.parse(query("API.Example.com"))
    assert (q.id, q.name, q.qtype) == (0x1234, "api.example.com", dns.TYPE_A)
    out = dns.answer(q, dns.NOERROR, ["10.0.0.1", "10.0.0.2"])
    qid, flags, qd, an, ns, ar = struct.unpack("!HHHHHH", out[:12])
    assert (qid, flags & 0x8000, flags & 0xF, qd, an, ns, ar) == (0x1234, 0x8000, 0, 1, 2, 0, 0)
    assert flags & 0x0100  # recursion desired, copied
    p = 12 + len(q.question)
    addresses = []
    for _ in range(an):
        ptr, rtype, rclass, ttl, rdlen = struct.unpack("!HHHIH", out[p:p + 12])
        assert (ptr, rtype, rclass, ttl, rdlen) == (0xC00C, dns.TYPE_A, dns.CLASS_IN, dns.TTL, 4)
        addresses.append(".".join(str(b) for b in out[p + 12:p + 16]))
        p += 16
    assert addresses == ["10.0.0.1", "10.0.0.2"] and p == len(out)


def test_nxdomain_and_other_types_have_no_records() -> None:
    q = dns.parse(query("x.com"))
    out = dns.answer(q, dns.NXDOMAIN)
    assert struct.unpack("!HH", out[2:6])[0] & 0xF == dns.NXDOMAIN
    aaaa = dns.parse(query("x.com", qtype=28))
    assert struct.unpack("!H", dns.answer(aaaa, dns.NOERROR, ["1.2.3.4"])[6:8])[0] == 0


@pytest.mark.parametrize("data", [
    b"\x00" * 5,
    query("a.com")[:-2],  # no class
    query("a.com")[:14],  # the name runs past the end
    struct.pack("!HHHHHH", 1, 0x8100, 1, 0, 0, 0) + b"\x01a\x00\x00\x01\x00\x01",  # answer
    struct.pack("!HHHHHH", 1, 0x0100, 2, 0, 0, 0) + b"\x01a\x00\x00\x01\x00\x01",  # two qs
    struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01",  # pointer
])
def test_what_is_not_one_plain_query_is_refused(data: bytes) -> None:
    with pytest.raises(dns.BadQuery):
        dns.parse(data)


def test_an_error_answer_keeps_the_id() -> None:
    out = dns.error(query("a.com", qid=77), dns.FORMERR)
    assert out is not None and struct.unpack("!HH", out[:4]) == (77, 0x8100 | dns.FORMERR)
    assert dns.error(b"xx", dns.FORMERR) is None
