"""SNI and Host parsing (``aenv.egress.sniff``), on ClientHellos made by Python's own TLS
stack and on request heads as clients send them."""

from __future__ import annotations

import ssl

import pytest

from aenv.egress import sniff


def client_hello(server_name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = server_name is not None
    if server_name is None:
        ctx.verify_mode = ssl.CERT_NONE
    tls = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


def test_the_sni_of_a_real_client_hello() -> None:
    hello = client_hello("API.Example.COM")
    assert sniff.is_tls(hello)
    assert sniff.sni(hello) == "api.example.com"


def test_a_client_hello_without_sni() -> None:
    assert sniff.sni(client_hello(None)) is None


def test_a_partial_client_hello_asks_for_more() -> None:
    hello = client_hello("a.example.com")
    for cut in (0, 3, 5, len(hello) // 2, len(hello) - 1):
        with pytest.raises(sniff.NeedMore):
            sniff.sni(hello[:cut])


@pytest.mark.parametrize("data", [b"\x16\x03\x01\x00\x04\x02\x00\x00\x00",  # ServerHello
                                  b"\x17\x03\x03\x00\x01x"])  # application data
def test_what_is_not_a_client_hello_is_refused(data: bytes) -> None:
    with pytest.raises(sniff.NotParsable):
        sniff.sni(data)


def test_a_truncated_extension_list_is_refused_not_read_past() -> None:
    hello = bytearray(client_hello("a.example.com"))
    hello = hello[:5] + hello[5:60]  # the record claims more than the handshake holds
    hello[3:5] = (len(hello) - 5).to_bytes(2, "big")
    with pytest.raises(sniff.NotParsable):
        sniff.sni(bytes(hello))


def test_the_host_of_a_request_head() -> None:
    head = sniff.request_head(b"GET /x HTTP/1.1\r\nHost: Example.COM:8080\r\nA: b\r\n\r\nBODY")
    assert (head.method, head.target, head.host) == ("GET", "/x", "example.com")
    assert head.size == len(b"GET /x HTTP/1.1\r\nHost: Example.COM:8080\r\nA: b\r\n\r\n")
    assert sniff.request_head(b"GET / HTTP/1.0\r\n\r\n").host is None
    assert sniff.request_head(b"GET / HTTP/1.1\r\nhost: a.b.\r\n\r\n").host == "a.b"


def test_rendering_sets_headers_case_blind_and_closes() -> None:
    head = sniff.request_head(b"POST / HTTP/1.1\r\nHost: a\r\nauthorization: x\r\n"
                              b"Connection: keep-alive\r\n\r\n")
    out = head.render((("Authorization", "Bearer s"),), close=True).decode()
    assert out == ("POST / HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer s\r\n"
                   "Connection: close\r\n\r\n")


@pytest.mark.parametrize("data", [b"GET /\r\n\r\n", b"\x00\x01\x02 x y\r\n\r\n",
                                  b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
                                  b"GET / HTTP/2\r\n\r\n"])
def test_what_is_not_an_http1_request_is_refused(data: bytes) -> None:
    with pytest.raises(sniff.NotParsable):
        sniff.request_head(data)


def test_an_incomplete_head_asks_for_more_up_to_a_limit() -> None:
    with pytest.raises(sniff.NeedMore):
        sniff.request_head(b"GET / HTTP/1.1\r\nHost: a")
    with pytest.raises(sniff.NotParsable):
        sniff.request_head(b"GET / HTTP/1.1\r\nX: " + b"a" * sniff.MAX_HEAD)


@pytest.mark.parametrize("target, host", [
    ("/x", None), ("*", None), ("http://A.com/x", "a.com"), ("https://u:p@b.com:8443?q", "b.com"),
    ("http://[::1]:80/", "[::1]"), ("http://c.com.", "c.com"),
])
def test_the_host_an_absolute_target_names(target: str, host: str | None) -> None:
    head = sniff.request_head(f"GET {target} HTTP/1.1\r\nHost: a.com\r\n\r\n".encode())
    assert head.target_host == host
