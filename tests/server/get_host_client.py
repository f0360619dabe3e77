"""The E2B Python SDK as a user points it at aenv with TLS and wildcard DNS: only
``E2B_DOMAIN``, ``E2B_API_KEY`` and ``SSL_CERT_FILE`` (the server's CA) are set, so REST goes
to ``https://api.<domain>`` and envd to ``https://49983-<id>.<domain>``. The sandbox serves
a page on 8080, fetched at ``https://`` + ``get_host(8080)`` by urllib (system resolver,
default trust store, which ``SSL_CERT_FILE`` replaces). Run by tests/server/test_tls_e2e.py;
prints its observations as one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

from e2b import Sandbox

PAGE = "served from inside the sandbox over https\n"


def fetch(url: str, deadline: float) -> tuple[int, str]:
    """GET ``url``; 502 ("port is not open") while the server in the sandbox starts."""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            if e.code != 502 or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def main() -> None:
    out: dict[str, object] = {}
    sbx = Sandbox.create("base", timeout=600)
    try:
        out["sandbox_id"] = sbx.sandbox_id
        out["api_url"] = sbx.connection_config.api_url
        out["envd_url"] = sbx.envd_api_url
        out["echo"] = sbx.commands.run("echo hello over tls").stdout
        sbx.files.write("/home/user/www/index.html", PAGE)
        sbx.commands.run("cd /home/user/www && exec python3 -m http.server 8080",
                         background=True)
        out["host"] = sbx.get_host(8080)
        out["status"], out["body"] = fetch(f"https://{out['host']}/index.html",
                                           time.monotonic() + 180)
        # The signed file URL carries no routing headers: only its host name routes it.
        out["download_url"] = sbx.download_url("/home/user/www/index.html")
        out["download"] = fetch(str(out["download_url"]), time.monotonic() + 30)[1]
    finally:
        sbx.kill()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
