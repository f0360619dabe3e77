"""What the egress proxy adds to a guest's request: one GET on a new connection from the
stand-in guest of a real slot to an HTTP/TLS server in a namespace, under a CIDR policy
(direct, no proxy) and under domain policies (through the proxy: HTTP, TLS passed
through, TLS terminated with a header transform). The kinds are interleaved round by
round so a change of load hits all of them alike.

Run as root: ``.venv/bin/python benchmarks/egress_proxy.py [--n 200]``. Prints one JSON
object (milliseconds). Own names (``aesb``) and addresses (10.125.8-10.x), all removed at
the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.egress.ca import EgressCA
from aenv.egress.proxy import EgressProxy, Resolver
from aenv.network import NetworkSlot, host
from aenv.network.addressing import Addressing
from aenv.network.egress_guard import upstream_refused
from aenv.network.policy import EgressPolicy, header_rules
from benchmarks._common import emit, summary
from tests.network.egress_world import Guest, Internet
from tests.network.helpers import make_settings

INET_IP = "10.125.10.2"


async def _secret(name: str) -> str | None:
    return "secret" if name == "tok" else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("egress_proxy.py needs root")
    tmp = Path(tempfile.mkdtemp(prefix="aenv-bench-egress-"))
    addressing = Addressing(make_settings(tmp, name_prefix="aesb", host_cidr="10.125.8.0/24",
                                          veth_cidr="10.125.9.0/24"))
    host.prepare(addressing)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    inet = slot = guest = None
    try:
        inet = Internet(tmp, "aesb-inet", "aesb-i", "10.125.10.1", INET_IP)
        node_ca = EgressCA(tmp / "node-ca")
        proxy = EgressProxy(node_ca, _secret, resolver=Resolver(inet.hosts),
                            refused=upstream_refused(addressing), upstream_ca=inet.ca_file)
        asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(5)
        slot = NetworkSlot.create(addressing, 1, egress=proxy)
        guest = Guest(slot, "aesb-g1", INET_IP)
        direct = EgressPolicy.build(allow_out=[f"{INET_IP}/32"], deny_out=["0.0.0.0/0"])
        named = EgressPolicy.build(
            allow_out=["allowed.aes.test", "api.aes.test"], deny_out=["0.0.0.0/0"],
            rules=header_rules({"api.aes.test": [
                {"transform": {"headers": {"Authorization": "${e2b.secrets.tok}"}}}]}))
        site, node = inet.trusting(), _trusting(node_ca)
        kinds = {
            "direct_http": (direct, lambda: guest.request("allowed.aes.test")),
            "direct_tls": (direct, lambda: guest.request("allowed.aes.test", port=443,
                                                         tls=site)),
            "proxied_http": (named, lambda: guest.request("allowed.aes.test")),
            "proxied_tls_passthrough": (named, lambda: guest.request(
                "allowed.aes.test", port=443, tls=site)),
            "proxied_tls_transform": (named, lambda: guest.request(
                "api.aes.test", port=443, tls=node)),
        }
        samples: dict[str, list[float]] = {k: [] for k in kinds}
        for kind, (policy, call) in kinds.items():  # warm-up: leaf certificates, caches
            slot.set_policy(policy)
            assert call().endswith(b"\n"), kind
        for _ in range(args.n):
            for kind, (policy, call) in kinds.items():
                slot.set_policy(policy)
                t0 = time.perf_counter()
                out = call()
                samples[kind].append((time.perf_counter() - t0) * 1000)
                if not out.startswith(b"HTTP/1.1 200"):
                    raise SystemExit(f"{kind}: {out[:80]!r}")
        result = {k: summary(v) for k, v in samples.items()}
        result["added_p50_ms"] = {
            "http": result["proxied_http"]["p50"] - result["direct_http"]["p50"],
            "tls_passthrough": (result["proxied_tls_passthrough"]["p50"]
                                - result["direct_tls"]["p50"]),
            "tls_transform": (result["proxied_tls_transform"]["p50"]
                              - result["direct_tls"]["p50"]),
        }
        result["connections_through_proxy"] = proxy.connections
        emit(result)
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(5)
    finally:
        if guest is not None:
            guest.close()
        if slot is not None:
            slot.destroy()
        if inet is not None:
            inet.close()
        host.remove_table(addressing)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def _trusting(ca: EgressCA):  # type: ignore[no-untyped-def]
    import ssl

    return ssl.create_default_context(cafile=str(ca.directory / "ca.pem"))


if __name__ == "__main__":
    main()
