"""``aenv gateway`` over TLS, as ``aenv server`` takes it: ``--tls-self-signed`` serves the
local CA's certificate for ``--domain`` (clients that trust the CA verify it), and TLS
options that do not go together stop it before it listens. A real redis-server and a real
gateway process; no nodes needed."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.redis_server import RedisServer
from tests.cluster.test_cluster_e2e import GATEWAY_KEY, SECRET
from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.slow  # each case starts gateway processes: left out of make test-fast


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "AENV_HOME": str(home), "AENV_API_KEY": GATEWAY_KEY,
            "AENV_CLUSTER_SECRET": SECRET}


def test_the_gateway_serves_https_with_the_local_ca(redis_server: RedisServer,
                                                     tmp_path: Path) -> None:
    port = free_port()
    home = tmp_path / "gw"
    proc = subprocess.Popen(
        [sys.executable, "-m", "aenv.cli.main", "gateway", "--port", str(port), "--cluster",
         redis_server.url(5), "--tls-self-signed", "--domain", "aenv.test"],
        cwd=ROOT, env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        ca = home / "secrets/tls/aenv.test/ca.pem"
        trust = ssl.create_default_context(cafile=str(ca)) if ca.exists() else None
        deadline = time.monotonic() + 30
        url = f"https://127.0.0.1:{port}"
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            if trust is None and ca.exists():
                trust = ssl.create_default_context(cafile=str(ca))
            if trust is not None:
                try:
                    with httpx.Client(verify=trust, timeout=2) as c:
                        r = c.get(url + "/nodes", headers={"X-API-KEY": GATEWAY_KEY},
                                  extensions={"sni_hostname": "aenv.test"})
                    break
                except httpx.HTTPError:
                    pass
            assert time.monotonic() < deadline, "the gateway did not serve HTTPS"
            time.sleep(0.2)
        assert r.status_code == 200 and isinstance(r.json(), list)
        # verified: a client that does not trust the local CA is refused
        try:
            with httpx.Client(timeout=5) as c:
                c.get(url + "/health", extensions={"sni_hostname": "aenv.test"})
            raise AssertionError("an untrusted certificate was accepted")
        except httpx.ConnectError as e:
            assert "CERTIFICATE_VERIFY_FAILED" in str(e)
    finally:
        proc.terminate()
        proc.wait(15)
    out = proc.stdout.read().decode() if proc.stdout else ""
    assert f"TLS from the local CA {ca}" in out


def test_tls_options_that_do_not_go_together_stop_the_gateway(redis_server: RedisServer,
                                                              tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "aenv.cli.main", "gateway", "--port", str(free_port()),
         "--cluster", redis_server.url(5), "--tls-cert", str(tmp_path / "c.pem")],
        cwd=ROOT, env=_env(tmp_path / "gw"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "--tls-cert and --tls-key go together" in r.stderr
