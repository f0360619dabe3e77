"""The ``base`` image has the everyday tools of E2B's base template, usable by ``user``.

Each command runs the way the E2B SDK runs ``commands.run``: ``bash -l -c`` through envd,
as ``user`` unless a test says otherwise. Nothing here reaches a network: the guest boots
with QEMU's restricted user-mode network, so installs are from local files.
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import zipfile

import pytest

from tests.guest import connect

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]


def login_sh(guest, script: str, user: str = "user", timeout: float = 120) -> str:
    result = connect.run(guest.url, "/bin/bash", "-l", "-c", script, user=user,
                         timeout=timeout)
    assert result.exit_code == 0, (
        f"exit {result.exit_code}\nstdout: {result.stdout.decode()}\n"
        f"stderr: {result.stderr.decode()}")
    return result.stdout.decode() + result.stderr.decode()


def test_git_curl_and_wget_are_installed(guest):
    out = login_sh(guest, "git --version; curl --version; wget --version | head -1")
    assert re.search(r"^git version 2\.", out, re.MULTILINE)
    curl = re.search(r"^Protocols: (.*)$", out, re.MULTILINE)
    assert curl and "https" in curl.group(1).split(), out
    assert "GNU Wget" in out


def test_everyday_tools_of_e2b_base_are_on_the_path(guest):
    tools = ["ssh", "unzip", "xz", "bzip2", "file", "less", "sudo", "ps", "pip", "pip3",
             "npx", "corepack"]
    out = login_sh(guest, f"for t in {' '.join(tools)}; do command -v $t || echo missing $t; "
                          "done")
    assert "missing" not in out, out


def test_python_is_python3(guest):
    out = login_sh(guest, "python --version; python -c 'import sys; print(sys.executable)'; "
                          "cd /tmp && printf 'print(6 * 7)\\n' > s.py && python s.py")
    assert re.search(r"^Python 3\.11\.", out, re.MULTILINE), out
    assert out.rstrip().endswith("42")


def _wheel_b64() -> str:
    """A one-module pure-Python wheel, made here (no build backend runs in the guest)."""
    files = {"aenvdemo/__init__.py": b"ANSWER = 42\n",
             "aenvdemo-1.0.dist-info/METADATA":
                 b"Metadata-Version: 2.1\nName: aenvdemo\nVersion: 1.0\n",
             "aenvdemo-1.0.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: aenv-test\nRoot-Is-Purelib: true\n"
                 b"Tag: py3-none-any\n"}

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{name},sha256={digest(data)},{len(data)}\n"
                     for name, data in files.items())
    record += "aenvdemo-1.0.dist-info/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr("aenvdemo-1.0.dist-info/RECORD", record)
    return base64.b64encode(buf.getvalue()).decode()


def test_user_pip_installs_into_usr_local_like_e2b(guest):
    """As in E2B's base, plain ``pip install`` works for ``user``: no externally-managed
    refusal, no --user or --break-system-packages, and /usr/local takes it."""
    script = (
        "set -e; d=$(mktemp -d)\n"
        f"echo {_wheel_b64()} | base64 -d > $d/aenvdemo-1.0-py3-none-any.whl\n"
        "pip install -q --no-index --disable-pip-version-check $d/aenvdemo-1.0-py3-none-any.whl\n"
        "cd / && python -c 'import aenvdemo; print(aenvdemo.ANSWER, aenvdemo.__file__)'\n"
    )
    out = login_sh(guest, script, timeout=240)
    assert re.search(r"^42 /usr/local/lib/python3\.11/dist-packages/aenvdemo/", out,
                     re.MULTILINE), out


def test_node_is_20_or_newer_and_npm_runs(guest):
    out = login_sh(guest, "node --version; npm --version; node -e 'console.log(6 * 7)'")
    node = re.search(r"^v(\d+)\.\d+\.\d+$", out, re.MULTILINE)
    assert node and int(node.group(1)) >= 20, out  # E2B's base has Node 20
    assert re.search(r"^\d+\.\d+\.\d+$", out, re.MULTILINE), out
    assert out.rstrip().endswith("42")


def test_user_npm_installs_a_global_package_like_e2b(guest):
    """``npm install -g`` as ``user`` works (E2B's /usr/local is writable by everyone)."""
    script = (
        "set -e; d=$(mktemp -d)\n"
        "printf '{\"name\":\"aenv-hello\",\"version\":\"1.0.0\",\"bin\":{\"aenv-hello\":"
        "\"hello.js\"}}' > $d/package.json\n"
        "printf '#!/usr/bin/env node\\nconsole.log(\"hello from npm\")\\n' > $d/hello.js\n"
        "npm install -g --offline --no-audit --no-fund --silent $d\n"
        "cd / && aenv-hello && ls -d /usr/local/lib/node_modules/aenv-hello\n"
    )
    out = login_sh(guest, script, timeout=240)
    assert "hello from npm" in out, out
    assert "/usr/local/lib/node_modules/aenv-hello" in out, out


def test_user_sudo_needs_no_password(guest):
    out = login_sh(guest, "sudo -n true && sudo -n id -u")
    assert out.split()[-1] == "0"


def test_user_git_init_add_and_commit(guest):
    script = (
        "set -e; d=$(mktemp -d) && cd $d\n"
        "git init -q -b main .\n"
        "git config --global user.name 'Sandbox Bot'\n"
        "git config --global user.email sandbox@example.com\n"
        "echo hello > README.md && git add README.md && git commit -q -m 'first commit'\n"
        "git log -1 --pretty='%an|%s'; git rev-parse --abbrev-ref HEAD\n"
    )
    out = login_sh(guest, script)
    assert out.split() == ["Sandbox", "Bot|first", "commit", "main"], out
