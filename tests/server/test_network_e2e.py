"""Egress rules of a running sandbox through the real SDK: ``update_network`` applies at
once, clears what it leaves out, and stays with the sandbox across pause/resume and fork.

The "internet" is a network namespace of the test's own (``FakeInternet``: a TEST-NET-2
address with a listener), reached from the guest through the host as real egress is.
"""

from __future__ import annotations

import time

import httpx
import pytest
from e2b import Sandbox, SandboxException

from tests.network.helpers import INET_PEER_IP, FakeInternet

pytestmark = [pytest.mark.vm, pytest.mark.net]


@pytest.fixture(scope="module")
def internet():
    inet = FakeInternet()
    try:
        yield inet
    finally:
        inet.close()


def reaches(sbx: Sandbox, port: int) -> bool:
    """Whether the guest can open a TCP connection to the fake internet's listener."""
    script = (f"import socket; s = socket.create_connection(('{INET_PEER_IP}', {port}), 3); "
              "print(s.recv(64).decode().split()[0])")
    r = sbx.commands.run(f'python3 -c "{script}"', timeout=30)
    return r.exit_code == 0 and r.stdout.strip() == "internet"


def run_allowing_failure(sbx: Sandbox, port: int) -> bool:
    try:
        return reaches(sbx, port)
    except Exception:  # CommandExitException: the connection was refused
        return False


def test_update_network_applies_clears_and_survives_pause_and_fork(sdk, internet) -> None:
    port = internet.public.port
    sbx = Sandbox.create("base", timeout=300)
    children: list[Sandbox] = []
    try:
        assert run_allowing_failure(sbx, port)
        sbx.update_network({"deny_out": [INET_PEER_IP]})
        assert not run_allowing_failure(sbx, port), "denyOut did not apply to the running VM"

        sbx.pause()
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert not run_allowing_failure(sbx, port), "the rule was lost on resume"

        children = [c for c in sbx.fork(count=1) if isinstance(c, Sandbox)]
        assert len(children) == 1
        assert not run_allowing_failure(children[0], port), "a fork child lost the rule"

        sbx.update_network({})  # an update replaces everything: {} clears the deny list
        assert run_allowing_failure(sbx, port)
    finally:
        for c in children:
            c.kill()
        sbx.kill()


def test_update_network_of_a_paused_sandbox_is_409_and_of_a_missing_one_404(sdk) -> None:
    sbx = Sandbox.create("base")
    try:
        sbx.pause()
        with pytest.raises(SandboxException, match="409"):
            Sandbox.update_network(sbx.sandbox_id, {"deny_out": ["8.8.8.8"]})
    finally:
        sbx.kill()
    with httpx.Client(base_url=sdk.url, headers={"X-API-KEY": sdk.api_key}) as c:
        r = c.put("/sandboxes/nosuchsandbox/network", json={"denyOut": ["8.8.8.8"]})
        assert r.status_code == 404 and r.json()["code"] == 404


@pytest.mark.parametrize("network, named", [
    ({"rules": {"*": [{"transform": {"headers": {"X": "1"}}}]}}, "rules"),
    ({"rules": {"a.example.com": [{"transform": {"headers": {
        "X": "${e2b.identity.tokens.aws}"}}}]}}, "rules"),
    ({"egressProxy": {"address": "proxy.example.com"}}, "egressProxy"),  # no port
    ({"maskRequestHost": "bad host\r\nX: y"}, "maskRequestHost"),
    ({"httpsPorts": [49983]}, "httpsPorts"),
    ({"dnsServers": ["not-an-ip"]}, "dnsServers"),
    ({"allowOut": ["not a name!"]}, "not a name!"),
])
def test_unsupported_network_options_are_refused_by_name(sdk, network, named) -> None:
    with httpx.Client(base_url=sdk.url, headers={"X-API-KEY": sdk.api_key}) as c:
        before = len(c.get("/v2/sandboxes").json())
        r = c.post("/v2/sandboxes", json={"templateID": "base", "network": network})
        assert r.status_code == 400, r.text
        assert named in r.json()["message"]
        assert len(c.get("/v2/sandboxes").json()) == before  # nothing was made


ECHO_HOST = ("import http.server as h\n"
             "class H(h.BaseHTTPRequestHandler):\n"
             "    def do_GET(self):\n"
             "        b = ''.join(f'{k}: {v}' for k, v in self.headers.items()\n"
             "                    if k.lower() == 'host').encode()\n"
             "        self.send_response(200); self.send_header('Content-Length', str(len(b)))\n"
             "        self.end_headers(); self.wfile.write(b)\n"
             "h.HTTPServer(('0.0.0.0', 8080), H).serve_forever()\n")


def echo_host_through_proxy(sdk, sbx: Sandbox) -> httpx.Response:
    """Start ``ECHO_HOST`` on the sandbox's port 8080 and ask it through the server's proxy
    until it answers 200 (20 s at most): the last answer."""
    sbx.files.write("/tmp/echo_host.py", ECHO_HOST)
    sbx.commands.run("python3 /tmp/echo_host.py", background=True)
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8080"}
    with httpx.Client(base_url=sdk.url) as c:
        for _ in range(100):
            r = c.get("/", headers=headers)
            if r.status_code == 200:
                break
            time.sleep(0.2)
    return r


def test_mask_request_host_is_the_host_user_ports_see(sdk) -> None:
    """E2B's test_mask_request_host: the in-sandbox server sees the masked Host, with
    ${PORT} replaced; envd's port is not masked (the SDK keeps working)."""
    sbx = Sandbox.create("base", network={"mask_request_host": "custom-host.example.com:${PORT}"})
    try:
        r = echo_host_through_proxy(sdk, sbx)
        assert r.status_code == 200, r.text
        # As E2B's proxy spells it: E2B's test greps the raw request for "Host:".
        assert r.text == "Host: custom-host.example.com:8080"
    finally:
        sbx.kill()


def test_only_the_server_reaches_a_sandbox_host_address(sdk) -> None:
    """Another process on the host (root, but without the server's socket mark) cannot
    open a connection to a sandbox's host address; the server's proxy can."""
    import socket
    import sqlite3

    sbx = Sandbox.create("base")
    try:
        r = echo_host_through_proxy(sdk, sbx)
        assert r.status_code == 200, r.text  # through the server
        with sqlite3.connect(sdk.home / "aenv.db") as db:
            (host_ip,) = db.execute("SELECT host_ip FROM sandboxes WHERE id = ?",
                                    (sbx.sandbox_id,)).fetchone()
        with pytest.raises(OSError):
            socket.create_connection((host_ip, 8080), timeout=3).close()
    finally:
        sbx.kill()


TLS_SERVER = ("import http.server as h, ssl\n"
              "class H(h.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        b = b'tls ' + self.headers.get('Host', '').encode()\n"
              "        self.send_response(200); self.send_header('Content-Length', str(len(b)))\n"
              "        self.end_headers(); self.wfile.write(b)\n"
              "s = h.HTTPServer(('0.0.0.0', 8443), H)\n"
              "c = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); c.load_cert_chain('/tmp/tls.pem')\n"
              "s.socket = c.wrap_socket(s.socket, server_side=True)\n"
              "s.serve_forever()\n")


def test_https_ports_reach_a_tls_server_in_the_sandbox_by_get_host(sdk, tmp_path) -> None:
    """``https_ports``: the proxy speaks TLS to the guest's port 8443 (a self-signed
    certificate nobody trusts) when the request names ``get_host(8443)``; the option is
    read back as given."""
    from aenv.egress.ca import EgressCA

    cert, key = EgressCA(tmp_path / "ca").leaf("sandbox.invalid")
    sbx = Sandbox.create("base", network={"https_ports": [8443]})
    try:
        with httpx.Client(base_url=sdk.url, headers={"X-API-KEY": sdk.api_key}) as c:
            assert c.get(f"/sandboxes/{sbx.sandbox_id}").json()["network"]["httpsPorts"] == \
                [8443]
        sbx.files.write("/tmp/tls.pem", (cert + key).decode())
        sbx.files.write("/tmp/tls_server.py", TLS_SERVER)
        sbx.commands.run("python3 /tmp/tls_server.py", background=True)
        host = sbx.get_host(8443)
        with httpx.Client(base_url=sdk.url, headers={"Host": host}) as c:
            for _ in range(150):
                r = c.get("/")
                if r.status_code == 200:
                    break
                time.sleep(0.2)
        assert r.status_code == 200, r.text
        assert r.text.startswith("tls ")
    finally:
        sbx.kill()
