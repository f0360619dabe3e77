"""``network`` options at create and ``PUT /sandboxes/{id}/network`` through the real
routes over fake machines: ``dnsServers`` and ``httpsPorts`` are checked, kept and read
back as E2B's SDKs send them (spec part 2, section 3), and the policy the node applies
follows them."""

from __future__ import annotations

import httpx
import pytest

from aenv.network.policy import DEFAULT_DNS_SERVERS
from aenv.orchestrator.node import egress_policy
from tests.api.api_world import AUTH, make_world


@pytest.fixture
async def api(tmp_path):
    world = make_world(tmp_path / "build-files")
    transport = httpx.ASGITransport(world.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as c:
        yield world, c


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
                        json={"denyOut": ["8.8.8.8"], "httpsPorts": [9000]})).status_code == 204
    network = (await c.get(f"/sandboxes/{sid}")).json()["network"]
    assert network == {"httpsPorts": [3000, 8443], "denyOut": ["8.8.8.8"]}


@pytest.mark.parametrize("ports, says", [([49983], "49983"), ([0], "not a port"),
                                         ([70000], "not a port")])
async def test_envds_port_and_non_ports_are_refused_in_https_ports(api, ports, says) -> None:
    _, c = api
    before = len((await c.get("/v2/sandboxes")).json())
    r = await _create(c, {"httpsPorts": ports})
    assert r.status_code == 400 and says in r.json()["message"], r.text
    assert len((await c.get("/v2/sandboxes")).json()) == before


async def test_an_egress_proxy_is_still_refused_by_name(api) -> None:
    _, c = api
    r = await _create(c, {"egressProxy": {"address": "proxy.example.com:1080"}})
    assert r.status_code == 400 and "egressProxy" in r.json()["message"]
