"""``aenv server``'s TLS options: a bad combination or a certificate that cannot be served
stops the server at start with one line naming the option or file, before it builds
anything. (tests/server/test_tls_e2e.py serves a real SDK over TLS.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.network import cleanup_leftovers
from aenv.tls import local_ca
from tests.conftest import ROOT, free_port, stop_process

# Each case starts an ``aenv server`` process (seconds of imports): left out of make test-fast.
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="aenv server needs root"),
              pytest.mark.slow]

PREFIX = "aenvsx"  # its own name prefix: the prefix lock is host-wide


def _server(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "aenv.cli.main", "server", "--port", str(free_port()), *args],
        cwd=ROOT, env={**base, "AENV_HOME": str(home), "AENV_NAME_PREFIX": PREFIX, **env},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        cleanup_leftovers(Settings(home=home, name_prefix=PREFIX))
        pytest.fail("aenv server did not refuse to start")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _refused(r: subprocess.CompletedProcess, message: str) -> None:
    assert r.returncode == 1, r.stderr[-2000:]
    assert message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_certificate_without_its_key_is_refused(tmp_path: Path) -> None:
    made = local_ca(tmp_path / "tls", "aenv.test")
    _refused(_server(tmp_path / "home", "--tls-cert", str(made.cert)),
             "aenv server: --tls-cert and --tls-key go together")
    _refused(_server(tmp_path / "home", AENV_TLS_KEY=str(made.key)),
             "--tls-cert and --tls-key go together")


def test_a_certificate_and_self_signed_are_refused_together(tmp_path: Path) -> None:
    made = local_ca(tmp_path / "tls", "aenv.test")
    r = _server(tmp_path / "home", "--tls-self-signed",
                AENV_TLS_CERT=str(made.cert), AENV_TLS_KEY=str(made.key))
    _refused(r, "either --tls-cert/--tls-key or --tls-self-signed")
    assert not (tmp_path / "home/secrets/tls").exists()


def test_a_key_that_does_not_fit_is_refused_naming_the_files(tmp_path: Path) -> None:
    made = local_ca(tmp_path / "tls", "aenv.test")
    wrong = made.ca.parent / "ca-key.pem"
    _refused(_server(tmp_path / "home", "--tls-cert", str(made.cert), "--tls-key", str(wrong)),
             f"the TLS key {wrong} does not fit the certificate {made.cert}")


def test_self_signed_with_a_domain_that_is_no_host_name_is_refused(tmp_path: Path) -> None:
    r = _server(tmp_path / "home", "--tls-self-signed", AENV_DOMAIN="10.0.0.1")
    _refused(r, "AENV_DOMAIN (--domain) '10.0.0.1' is not a DNS name")
