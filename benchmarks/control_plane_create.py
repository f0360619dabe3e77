"""Control-plane cost of a sandbox create (and of a kill) against a real ``aenv server``.

Run as root: ``.venv/bin/python benchmarks/control_plane_create.py [--n 20] [--warmup 1]``
(``--data-dir DIR --cache-home DIR`` put the home and the kernel/image cache elsewhere, e.g.
both on one XFS or btrfs mount so disks are reflinks; ``--cprofile FILE`` runs the server
under cProfile, which slows it: use it to see where time goes, not for the figures).

Method: starts ``aenv server`` (``python -m aenv.cli.main server``) in a child process with
its own home (a temporary directory), name prefix and address ranges, sharing the host's
kernel and image cache (``AENV_CACHE_HOME`` = the default data dir's artifacts), with the
default warm pool of network slots. It then makes ``--warmup`` + ``--n`` sequential
creates from ``base`` with httpx (``POST /v2/sandboxes``, one keep-alive connection), and
after each create a ``DELETE /sandboxes/{id}``. Per create it parses the ``Server-Timing``
header (milliseconds per phase: api, orchestrator, queue, slot, disk, prepare, pool, vmm,
memory, state_load, kernel, init, envd, envd_init) and takes the client-side wall time; per
kill, the client-side wall time.
The warm-up creates (first disk probe, accelerator choice, cold caches) are reported apart
and left out of the percentiles. A phase a create's ``Server-Timing`` does not name is left
out of that phase's figures (each has its own ``n``), never counted as 0 ms; the control
plane sum is taken only over creates that name every control-plane phase the mode has
(``control_plane_missing`` counts the others, which are left out).

``--mode cold`` (default) makes the server boot every sandbox (``--no-snapshot-base``);
``--mode restore`` measures the server's default, where creates restore base's snapshot
(phases slot, prepare, vmm, memory, state_load, envd, envd_init; or pool and state_load when
the create took a pre-started VMM, ``aenv.runtime.vmm_pool``).

``control_plane`` is api + orchestrator + slot + disk + prepare: everything except starting
the VMM, the guest's boot (or restore) and the round trips to envd. ``client_gap`` is wall time
minus the sum of all phases (HTTP, JSON, uvicorn, the client). The goal is a control plane under
5 ms p50 (``goal_met``).

Clean-up, also on failure: every sandbox is killed through the API, the server gets SIGTERM,
and then the script checks that no netns, nft table, VMM process or guest-RAM file of its
prefix remains (``leftovers`` in the output; anything found is removed with
``cleanup_leftovers``). ``disk_methods`` is how the node made the sandbox disks (from its
log): ``qcow2`` (a ``qemu-img create`` process per sandbox) or ``reflink`` (FICLONE).

Output: one JSON object, milliseconds. The host has 2 shared cores and the guests run under
TCG: the boot phases are noisy; compare p50s across runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from aenv.orchestrator.timing import parse_server_timing
from benchmarks._common import emit, phase_summaries, summary
from benchmarks._server import VMServer, leftovers, log

PHASES = ("api", "orchestrator", "queue", "slot", "disk", "prepare", "pool", "vmm", "memory",
          "state_load", "kernel", "init", "envd", "envd_init")
CONTROL_PLANE = ("api", "orchestrator", "slot", "disk", "prepare")
GOAL_MS = 5.0
DISK_METHOD = re.compile(r"sandbox \w+: slot \d+, disk (\w+),")  # the node's create log line
def create_and_kill(api: httpx.Client) -> tuple[float, dict[str, float], float]:
    """One create and its kill: (create wall ms, Server-Timing phases ms, kill wall ms)."""
    t0 = time.perf_counter()
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
    wall = (time.perf_counter() - t0) * 1000
    if r.status_code != 201:
        raise RuntimeError(f"create answered {r.status_code}: {r.text}")
    phases = parse_server_timing(r.headers.get("server-timing", ""))
    sid = r.json()["sandboxID"]
    t1 = time.perf_counter()
    k = api.delete(f"/sandboxes/{sid}")
    kill = (time.perf_counter() - t1) * 1000
    if k.status_code != 204:
        raise RuntimeError(f"kill of {sid} answered {k.status_code}: {k.text}")
    return wall, phases, kill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="measured creates")
    ap.add_argument("--warmup", type=int, default=1, help="creates left out of the figures")
    ap.add_argument("--net", type=int, default=94,
                    help="second octet of the server's host (10.N.0/24) and veth ranges")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="where the server's temporary home is made (default: the system "
                         "temp dir); its filesystem decides reflink or qcow2 disks")
    ap.add_argument("--cache-home", type=Path, default=None,
                    help="kernels and images (default: the default data dir's artifacts)")
    ap.add_argument("--mode", choices=("cold", "restore"), default="cold",
                    help="cold: every create boots (server --no-snapshot-base); restore: "
                         "creates restore base's snapshot (the server's default)")
    ap.add_argument("--cprofile", type=Path, metavar="FILE",
                    help="run the server under cProfile and write its stats to FILE")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("control_plane_create.py needs root (network namespaces, VMs)")

    home = Path(tempfile.mkdtemp(prefix="aenv-bench-cp-", dir=args.data_dir))
    srv = VMServer(home, args.net, args.cache_home or Settings.from_env().artifacts,
                   args.cprofile,
                   server_args=("--no-snapshot-base",) if args.mode == "cold" else ())
    result: dict[str, Any] = {"benchmark": "control_plane_create", "mode": args.mode,
                              "n": args.n,
                              "load_before": os.getloadavg()}
    rows: list[tuple[float, dict[str, float], float]] = []
    try:
        log(f"starting aenv server (home {home}, prefix {srv.settings.name_prefix})")
        srv.start()
        with srv.api() as api:
            warm = []
            for i in range(args.warmup + args.n):
                row = create_and_kill(api)
                (warm if i < args.warmup else rows).append(row)
                log(f"create {i + 1}/{args.warmup + args.n}: {row[0]:.0f} ms, "
                    f"control plane {sum(row[1].get(p, 0) for p in CONTROL_PLANE):.2f} ms, "
                    f"kill {row[2]:.0f} ms")
        result["warmup"] = [{"wall_ms": round(w, 2), "phases_ms": p, "kill_ms": round(k, 2)}
                            for w, p, k in warm]
    except BaseException:
        if srv.log_path.exists():
            log("server log tail:\n" + srv.log_path.read_text(errors="replace")[-4000:])
        raise
    finally:
        try:
            if srv.proc is not None and srv.proc.poll() is None:
                result["killed_at_end"] = srv.kill_all()
        except Exception as e:  # still stop the server and look for leftovers
            log(f"kill at end failed: {e}")
        srv.stop()
        result["disk_methods"] = sorted(set(DISK_METHOD.findall(
            srv.log_path.read_text(errors="replace")))) if srv.log_path.exists() else []
        left = leftovers(srv.settings)
        result["leftovers"] = left
        if any(left.values()):
            from aenv.network import cleanup_leftovers

            log(f"leftovers found, removing: {left}")
            cleanup_leftovers(srv.settings)
            for name in left["shm_files"]:
                Path("/dev/shm", name).unlink(missing_ok=True)
        shutil.rmtree(home, ignore_errors=True)

    walls = [w for w, _, _ in rows]
    phase_rows = [ph for _, ph, _ in rows]
    phases = {p: s for p, s in phase_summaries(phase_rows, PHASES).items() if s["n"]}
    # The control-plane phases this mode has (a restore makes no disk of its own): those
    # any create reported. A create missing one of them is not summed as if it took 0 ms.
    expected = [p for p in CONTROL_PLANE if any(p in ph for ph in phase_rows)]
    complete = [(w, ph) for w, ph, _ in rows if all(p in ph for p in expected)]
    control = [sum(ph[p] for p in expected) for _, ph in complete]
    gap = [w - sum(ph.values()) for w, ph in complete]
    control_summary = summary(control)
    result.update({
        "create_wall_ms": summary(walls),
        "phases_ms": phases,
        "control_plane_ms": control_summary,
        "control_plane_phases": expected,
        "control_plane_missing": len(rows) - len(complete),
        "client_gap_ms": summary(gap),
        "kill_wall_ms": summary([k for _, _, k in rows]),
        "goal_ms": GOAL_MS,
        "goal_met": bool(control) and control_summary["p50"] < GOAL_MS,
        "load_after": os.getloadavg(),
    })
    emit(result)


if __name__ == "__main__":
    main()
