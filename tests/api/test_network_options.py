"""``network`` options at create and ``PUT /sandboxes/{id}/network`` through the real
routes over fake machines: ``dnsServers`` and ``httpsPorts`` are checked, kept and read
back as E2B's SDKs send them (spec part 2, section 3), and the policy the node applies
follows them."""

from __future__ import annotations

import httpx
import pytest

from aenv.network.policy import DEFAULT_DNS_SERVERS
from aenv.orchestrator.node import egress_policy


async def _create(c: httpx.AsyncClient, network: dict) -> httpx.Response:
    return await c.post("/v2/sandboxes", json={"templateID": "base", "network": network})


async def test_dns_servers_are_read_back_and_an_update_without_them_resets_them(api) -> None:
    world, c = api
    r = await _create(c, {"allowOut": ["example.com"], "denyOut": ["0.0.0.0/0"],
                          "dnsServers": ["1.1.1.1", "9.9.9.9"]})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    assert (await c.get(f"/sandboxes/{sid}")).json()["network"]["dnsServers"] == \
        ["1.1.1.1", "9.9.9.9"]
    rec = world.orchestrator.sandboxes.get(sid)
    assert egress_policy(rec).dns_opened == ("1.1.1.1", "9.9.9.9")

    r = await c.put(f"/sandboxes/{sid}/network", json={"allowOut": ["example.com"],
                                                        "dnsServers": []})
    assert r.status_code == 204
    assert (await c.get(f"/sandboxes/{sid}")).json()["network"]["dnsServers"] == []
    assert egress_policy(world.orchestrator.sandboxes.get(sid)).dns_servers == ()

    assert (await c.put(f"/sandboxes/{sid}/network", json={"allowOut": ["example.com"]})
            ).status_code == 204
    assert "dnsServers" not in (await c.get(f"/sandboxes/{sid}")).json()["network"]
    assert egress_policy(world.orchestrator.sandboxes.get(sid)).dns_servers == \
        DEFAULT_DNS_SERVERS


@pytest.mark.parametrize("servers", [["dns.example.com"], ["1.1.1.1/32"],
                                     [f"10.0.0.{i}" for i in range(11)]])
async def test_bad_dns_servers_are_a_400(api, servers) -> None:
    _, c = api
    r = await _create(c, {"dnsServers": servers})
    assert r.status_code == 400 and "dnsServers" in r.json()["message"]


async def test_https_ports_are_kept_read_back_and_outlive_an_update(api) -> None:
    _, c = api
    r = await _create(c, {"httpsPorts": [3000, 8443, 3000]})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    assert (await c.get(f"/sandboxes/{sid}")).json()["network"]["httpsPorts"] == [3000, 8443]
    # Create-only: a whole-replacing update keeps them, and cannot change them.
    assert (await c.put(f"/sandboxes/{sid}/network",
                        json={"denyOut": ["8.8.8.8"]})).status_code == 204
    network = (await c.get(f"/sandboxes/{sid}")).json()["network"]
    assert network == {"httpsPorts": [3000, 8443], "denyOut": ["8.8.8.8"]}


@pytest.mark.parametrize("field, value", [("httpsPorts", [9000]),
                                          ("allowPublicTraffic", False),
                                          ("maskRequestHost", "example.com")])
async def test_an_update_that_sets_a_create_only_option_is_refused_by_name(
        api, field, value) -> None:
    _, c = api
    r = await _create(c, {"httpsPorts": [3000], "denyOut": ["1.1.1.1"]})
    sid = r.json()["sandboxID"]
    before = (await c.get(f"/sandboxes/{sid}")).json()["network"]
    r = await c.put(f"/sandboxes/{sid}/network", json={"denyOut": ["8.8.8.8"], field: value})
    assert r.status_code == 400 and field in r.json()["message"], r.text
    assert r.json()["code"] == 400
    assert (await c.get(f"/sandboxes/{sid}")).json()["network"] == before


@pytest.mark.parametrize("ports, says", [([49983], "49983"), ([0], "not a port"),
                                         ([70000], "not a port")])
async def test_envds_port_and_non_ports_are_refused_in_https_ports(api, ports, says) -> None:
    _, c = api
    before = len((await c.get("/v2/sandboxes")).json())
    r = await _create(c, {"httpsPorts": ports})
    assert r.status_code == 400 and says in r.json()["message"], r.text
    assert len((await c.get("/v2/sandboxes")).json()) == before


PROXY = {"address": "proxy.example.com:1080", "username": "u", "password": "p",
         "tls": {"enabled": True, "serverName": "px.example.com", "caCert": None}}


async def test_an_egress_proxy_is_read_back_without_password_or_ca(api, tmp_path) -> None:
    from aenv.egress.ca import EgressCA

    world, c = api
    pem = (EgressCA(tmp_path / "ca").directory / "ca.pem").read_text()
    proxy = {**PROXY, "tls": {**PROXY["tls"], "caCert": pem}, "unknown": 1}
    r = await _create(c, {"allowOut": ["example.com"], "egressProxy": proxy})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    shown = (await c.get(f"/sandboxes/{sid}")).json()["network"]["egressProxy"]
    assert shown == {"address": "proxy.example.com:1080", "username": "u",
                     "tls": {"enabled": True, "serverName": "px.example.com"}}
    upstream = egress_policy(world.orchestrator.sandboxes.get(sid)).upstream
    assert upstream is not None and upstream.password == "p" and upstream.ca_cert == pem
    assert egress_policy(world.orchestrator.sandboxes.get(sid)).needs_proxy

    # An update sets it again (here without TLS), and one without it clears it.
    assert (await c.put(f"/sandboxes/{sid}/network", json={
        "egressProxy": {"address": "10.9.9.9:1080"}})).status_code == 204
    assert (await c.get(f"/sandboxes/{sid}")).json()["network"]["egressProxy"] == \
        {"address": "10.9.9.9:1080"}
    assert egress_policy(world.orchestrator.sandboxes.get(sid)).upstream.tls is False
    assert (await c.put(f"/sandboxes/{sid}/network", json={})).status_code == 204
    assert "egressProxy" not in ((await c.get(f"/sandboxes/{sid}")).json().get("network") or {})
    assert egress_policy(world.orchestrator.sandboxes.get(sid)).upstream is None


@pytest.mark.parametrize("proxy, says", [
    ({"username": "u"}, "address"),
    ({"address": "proxy.example.com"}, "host:port"),
    ({"address": "proxy.example.com:0"}, "host:port"),
    ({"address": "p:1080", "password": "p"}, "password without username"),
    ({"address": "p:1080", "username": "u" * 256}, "255"),
    ({"address": "p:1080", "tls": {"serverName": "x"}}, "enabled"),
    ({"address": "p:1080", "tls": {"enabled": False, "serverName": "x"}}, "enabled false"),
    ({"address": "p:1080", "tls": {"enabled": True, "caCert": "not pem"}}, "caCert"),
])
async def test_a_bad_egress_proxy_is_a_400_naming_what(api, proxy, says) -> None:
    _, c = api
    r = await _create(c, {"egressProxy": proxy})
    assert r.status_code == 400 and "egressProxy" in r.json()["message"], r.text
    assert says in r.json()["message"], r.text
