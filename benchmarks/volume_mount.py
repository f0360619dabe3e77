"""What a volume costs: creating a sandbox with a volume mounted vs without, and moving
bytes through a volume (content API and the guest's NFS mount) vs the guest's own disk.

Run as root: ``.venv/bin/python benchmarks/volume_mount.py [--n 5] [--mb 32]``

Method: one server (its own home, prefix and address ranges; ``benchmarks/_server.py``)
with base kept as a snapshot. Round by round, interleaved: ``POST /v2/sandboxes`` from
base without and with ``volumeMounts`` (client wall time to the 201; the server answers
once envd has mounted the volume), and the server's ``volumes`` phase from
``Server-Timing`` (NFS server start + envd's ``/init`` with the mount; the guest loads
the NFS modules on its first mount). Then, once: ``--mb`` MiB written and read through
the content API (``PUT``/``GET /volumecontent/.../file``), and by ``dd`` in the guest
to the mount and to ``/tmp`` (conv=fsync; reads after ``drop_caches``).

Output: one JSON object, milliseconds (throughputs in MiB/s). QEMU runs under TCG on
the development host and other sessions' VMs share its 2 cores: compare runs, not
single numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from aenv.orchestrator.timing import parse_server_timing
from benchmarks._common import emit, expect_status, summary
from benchmarks._server import VMServer, leftovers, log

MNT = "/mnt/bench"


def _mib_s(stdout: str, mb: int) -> float:
    """MiB/s from ``dd``'s last line ("..., 1.2 s, 27.9 MB/s"): the seconds, recomputed."""
    seconds = float(stdout.strip().splitlines()[-1].split(",")[-2].split()[0])
    return round(mb / seconds, 1)


def _guest_io(srv: VMServer, mb: int) -> dict[str, dict[str, float]]:
    """dd in a sandbox that mounts the volume: to the mount and to its own disk."""
    key = (srv.settings.secrets_dir / "api-key").read_text().strip()
    os.environ.update(E2B_API_KEY=key, E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url)
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=600, volume_mounts={MNT: "bench"})
    out: dict[str, dict[str, float]] = {}
    try:
        for where in (MNT, "/tmp"):
            w = sbx.commands.run(f"dd if=/dev/zero of={where}/dd bs=1M count={mb} "
                                 "conv=fsync 2>&1", user="root", timeout=600)
            r = sbx.commands.run(f"sync; echo 3 > /proc/sys/vm/drop_caches; dd if={where}/dd "
                                 "of=/dev/null bs=1M 2>&1", user="root", timeout=600)
            out["volume" if where == MNT else "local_disk"] = {
                "write": _mib_s(w.stdout, mb), "read": _mib_s(r.stdout, mb)}
            sbx.commands.run(f"rm -f {where}/dd", user="root")
    finally:
        sbx.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--net", type=int, default=121)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("volume_mount.py needs root")
    tmp = Path(tempfile.mkdtemp(prefix="aenv-bench-volumes-"))
    (tmp / "home").mkdir()
    srv = VMServer(tmp / "home", args.net, Settings.from_env().artifacts)
    result: dict[str, object] = {"n": args.n, "mb": args.mb}
    try:
        log("starting the server (base snapshot)")
        srv.start()
        with srv.api() as c:
            vol = expect_status(c.post("/volumes", json={"name": "bench"}), 201).json()
            plain: list[float] = []
            mounted: list[float] = []
            phase: list[float] = []
            for i in range(args.n):
                for kind in ("plain", "mounted"):
                    body: dict[str, object] = {"templateID": "base", "timeout": 300}
                    if kind == "mounted":
                        body["volumeMounts"] = [{"name": "bench", "path": MNT}]
                    t0 = time.perf_counter()
                    r = expect_status(c.post("/v2/sandboxes", json=body), 201)
                    ms = (time.perf_counter() - t0) * 1000
                    (mounted if kind == "mounted" else plain).append(ms)
                    if kind == "mounted":
                        phases = parse_server_timing(r.headers.get("server-timing", ""))
                        phase.append(phases.get("volumes", 0.0))  # ms already
                    expect_status(c.delete(f"/sandboxes/{r.json()['sandboxID']}"), 204)
                log(f"round {i + 1}: plain {plain[-1]:.0f} ms, mounted {mounted[-1]:.0f} ms")
            result["create_plain"] = summary(plain)
            result["create_mounted"] = summary(mounted)
            result["volumes_phase"] = summary(phase)

            auth = {"Authorization": f"Bearer {vol['token']}"}
            data = os.urandom(args.mb * 1024 * 1024)
            base = f"{srv.url}/volumecontent/{vol['volumeID']}/file"
            t0 = time.perf_counter()
            expect_status(httpx.put(base, params={"path": "/blob", "force": "true"},
                                    content=data, headers=auth, timeout=600), 201)
            put_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = httpx.get(base, params={"path": "/blob"}, headers=auth, timeout=600)
            get_s = time.perf_counter() - t0
            assert got.content == data
            result["content_api_mib_s"] = {"write": round(args.mb / put_s, 1),
                                           "read": round(args.mb / get_s, 1)}
            result["guest_dd_mib_s"] = _guest_io(srv, args.mb)
            expect_status(c.delete(f"/volumes/{vol['volumeID']}"), 204)
    finally:
        try:
            srv.kill_all()
        except Exception as e:  # the server may be gone; leftovers say
            log(f"kill_all: {e}")
        srv.stop()
        left = leftovers(srv.settings)
        if any(left.values()):
            log(f"LEFTOVERS: {left}")
            result["leftovers"] = left
    emit(result)


if __name__ == "__main__":
    main()
