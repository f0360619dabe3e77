"""Domain egress rules and secret header transforms end to end: a real ``aenv server`` of
this file's own (prefix aenvsf), microVM sandboxes, the real E2B SDK (``Sandbox.create``
with ``network=``, ``Secret``), and an "internet" namespace with HTTP and TLS servers whose
certificates come from a test CA (``tests/network/egress_world.py``). The server resolves
the test names with ``AENV_EGRESS_HOSTS`` and trusts the test CA upstream with
``AENV_EGRESS_UPSTREAM_CA``. The guest resolves names through its own resolver (answered
by the node's egress DNS), then connects to the address with the name in Host or SNI.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox, Secret

from tests.network.egress_world import Internet, Socks5
from tests.server.conftest import ServerProcess, sdk_pointed_at, serving

pytestmark = [pytest.mark.vm, pytest.mark.net]

INET_IP = "10.125.3.2"
SECRET = "e2e-s3cr3t-value-9f2"
REQUEST = f"""\
import socket, ssl, sys
host, port, ca = sys.argv[1], int(sys.argv[2]), (sys.argv[3] if len(sys.argv) > 3 else "")
try:
    s = socket.create_connection(("{INET_IP}", port), timeout=10)
    if ca:
        s = ssl.create_default_context(cafile=ca).wrap_socket(s, server_hostname=host)
    s.sendall(("GET / HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n" % host).encode())
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        out += chunk
    sys.stdout.write(out.decode(errors="replace"))
except Exception as e:
    print("ERR", type(e).__name__, e)
"""
SYSTEM_CAS = "/etc/ssl/certs/ca-certificates.crt"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Internet]]:
    tmp = tmp_path_factory.mktemp("egress-e2e")
    inet = Internet(tmp, "aes-inet2", "aes-j", "10.125.3.1", INET_IP)
    try:
        srv = ServerProcess(tmp / "home", prefix="aenvsf", net=123)
        srv.env["AENV_EGRESS_HOSTS"] = str(inet.hosts)
        srv.env["AENV_EGRESS_UPSTREAM_CA"] = str(inet.ca_file)
        srv.env["AENV_EGRESS_PROXY_NETWORKS"] = "10.125.3.0/24"  # the test's SOCKS proxy
        with serving(srv), sdk_pointed_at(srv):
            yield srv, inet
    finally:
        inet.close()


def ask(sbx: Sandbox, host: str, port: int = 80, ca: str = "") -> str:
    return sbx.commands.run(f"python3 /tmp/req.py {host} {port} {ca}", timeout=60).stdout


def test_domain_rules_and_a_secret_transform_through_the_sdk(world) -> None:
    _, inet = world
    Secret.create("E2E-Token", SECRET)
    sbx = Sandbox.create("base", timeout=300, network={
        "allow_out": ["allowed.aes.test", "api.aes.test", "*.wild.aes.test"],
        "deny_out": ["0.0.0.0/0"],
        "rules": {"api.aes.test": [{"transform": {"headers": {
            "Authorization": "Bearer " + Secret.fill("e2e-token")}}}]},
    })
    try:
        # The guest's own resolver (8.8.8.8) is answered by the node, as the policy says.
        resolve = "python3 -c \"import socket; print(socket.gethostbyname('{}'))\" || echo no"
        assert sbx.commands.run(resolve.format("allowed.aes.test")).stdout.strip() == INET_IP
        assert sbx.commands.run(resolve.format("denied.aes.test")).stdout.strip() == "no"
        sbx.files.write("/tmp/req.py", REQUEST)
        sbx.files.write("/tmp/site-ca.pem", inet.ca_file.read_text())
        inet.clear()
        assert ask(sbx, "allowed.aes.test").endswith("ok allowed.aes.test\n")
        assert ask(sbx, "allowed.aes.test", 443, "/tmp/site-ca.pem").endswith(
            "ok allowed.aes.test\n")  # passed through: the site's own certificate
        assert ask(sbx, "a.wild.aes.test").endswith("ok a.wild.aes.test\n")
        seen = len(inet.seen())
        assert ask(sbx, "denied.aes.test").startswith("HTTP/1.1 403")
        assert ask(sbx, "denied.aes.test", 443, "/tmp/site-ca.pem").startswith("ERR")
        assert ask(sbx, "wild.aes.test").startswith("HTTP/1.1 403")  # not the apex
        assert ask(sbx, INET_IP).startswith("HTTP/1.1 403")  # the address as the name
        assert ask(sbx, "allowed.aes.test", 8080).startswith("ERR")  # CIDR rules
        assert len(inet.seen()) == seen, "a refused request reached a server"

        # The transform: TLS terminated with the node's CA, which the guest trusts, and
        # which envd names to runtimes with CA lists of their own (certifi, Node.js).
        out = ask(sbx, "api.aes.test", 443, SYSTEM_CAS)
        assert out.endswith("ok api.aes.test\n"), out
        env = sbx.commands.run("echo $SSL_CERT_FILE $REQUESTS_CA_BUNDLE; "
                               "grep -c BEGIN $NODE_EXTRA_CA_CERTS").stdout.split()
        assert env == [SYSTEM_CAS, SYSTEM_CAS, "1"], env
        assert ask(sbx, "api.aes.test", 443, "$REQUESTS_CA_BUNDLE").endswith(
            "ok api.aes.test\n")
        assert inet.https.seen[-1]["authorization"] == f"Bearer {SECRET}"
        assert SECRET not in out
        found = sbx.commands.run(f"grep -rl {SECRET} /etc /tmp /root /home || true").stdout
        assert found.strip() == ""

        Secret.update("e2e-token", "rotated")
        ask(sbx, "api.aes.test", 443, SYSTEM_CAS)
        assert inet.https.seen[-1]["authorization"] == "Bearer rotated"

        sbx.update_network({})  # cleared: no names, so no proxy; the private address is
        assert ask(sbx, "allowed.aes.test").startswith("ERR")  # refused as before
    finally:
        sbx.kill()
        Secret.destroy("e2e-token")


def test_domain_rules_survive_pause_resume_and_fork(world) -> None:
    sbx = Sandbox.create("base", timeout=300, network={
        "allow_out": ["allowed.aes.test"], "deny_out": ["0.0.0.0/0"]})
    children: list[Sandbox] = []
    try:
        sbx.files.write("/tmp/req.py", REQUEST)
        info = sbx.get_info()  # the SDK reads the network options back
        assert info.sandbox_id == sbx.sandbox_id
        sbx.pause()
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert ask(sbx, "allowed.aes.test").endswith("ok allowed.aes.test\n")
        assert ask(sbx, "denied.aes.test").startswith("HTTP/1.1 403")
        children = [c for c in sbx.fork(count=1) if isinstance(c, Sandbox)]
        assert len(children) == 1
        assert ask(children[0], "allowed.aes.test").endswith("ok allowed.aes.test\n")
        assert ask(children[0], "denied.aes.test").startswith("HTTP/1.1 403")
    finally:
        for c in children:
            c.kill()
        sbx.kill()


def test_network_options_are_read_back_and_bad_ones_refused(world) -> None:
    srv, _ = world
    with httpx.Client(base_url=srv.url, headers={"X-API-KEY": srv.api_key}) as c:
        r = c.post("/v2/sandboxes", json={"templateID": "base", "network": {
            "allowOut": ["*"], "denyOut": ["0.0.0.0/0"]}})
        assert r.status_code == 400 and "'*'" in r.json()["message"]
        r = c.post("/v2/sandboxes", json={"templateID": "base", "network": {"rules": {
            "a.test": [{"transform": {"headers": {"X": "${e2b.identity.tokens.x}"}}}]}}})
        assert r.status_code == 400 and "rules" in r.json()["message"]


def test_an_egress_proxy_and_dns_servers_through_the_sdk(world) -> None:
    """``egress_proxy``: the guest's allowed TCP leaves through the test's SOCKS5 proxy in
    the "internet" (an allowOut name as ATYP=domain, another port of a listed address by
    address), read back without the password; an update clears it. ``dns_servers``: the
    default (8.8.8.8, the guest's resolver) is answered by the node; ``[]`` answers
    nothing."""
    srv, inet = world
    socks = Socks5(inet.netns, INET_IP, 1080, credentials=("u", "p"))
    sbx: Sandbox | None = None
    rules = {"allow_out": ["allowed.aes.test", f"{INET_IP}/32"], "deny_out": ["0.0.0.0/0"]}
    try:
        sbx = Sandbox.create("base", timeout=300, network={**rules, "egress_proxy": {
            "address": f"{INET_IP}:1080", "username": "u", "password": "p"}})
        with httpx.Client(base_url=srv.url, headers={"X-API-KEY": srv.api_key}) as c:
            network = c.get(f"/sandboxes/{sbx.sandbox_id}").json()["network"]
        assert network["egressProxy"] == {"address": f"{INET_IP}:1080", "username": "u"}
        sbx.files.write("/tmp/req.py", REQUEST)
        assert ask(sbx, "allowed.aes.test").endswith("ok allowed.aes.test\n")
        assert ask(sbx, "plain", 8080).endswith("ok plain\n")
        assert socks.asked == [(3, "allowed.aes.test", 80, "u"), (1, INET_IP, 8080, "u")]
        resolve = "python3 -c \"import socket; print(socket.gethostbyname('{}'))\" || echo no"
        assert sbx.commands.run(resolve.format("allowed.aes.test")).stdout.strip() == INET_IP

        sbx.update_network({**rules, "dns_servers": []})  # no proxy now, and no resolver
        assert ask(sbx, "allowed.aes.test").endswith("ok allowed.aes.test\n")
        assert len(socks.asked) == 2  # straight out, as without egress_proxy
        assert sbx.commands.run(resolve.format("allowed.aes.test"),
                                timeout=60).stdout.strip() == "no"
        with httpx.Client(base_url=srv.url, headers={"X-API-KEY": srv.api_key}) as c:
            network = c.get(f"/sandboxes/{sbx.sandbox_id}").json()["network"]
        assert "egressProxy" not in network and network["dnsServers"] == []
    finally:
        if sbx is not None:
            sbx.kill()
        socks.close()
