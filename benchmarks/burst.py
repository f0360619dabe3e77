"""A burst of concurrent creates through the E2B SDK, as an RL worker makes them.

Run as root: ``.venv/bin/python benchmarks/burst.py [--n 64] [--rounds 1] [--compare]``

Method: starts ``aenv server`` in a child process (``benchmarks/_server.py``: its own home,
name prefix and address ranges, 10.<--net>.0/24, default 129; the host's kernel and image
cache; base kept as a snapshot, so each create is a restore), then ``--rounds`` times:
``asyncio.gather`` of ``--n`` ``AsyncSandbox.create("base")`` with the E2B Python SDK, all
released at once. Per create: the latency from the burst's start to its answer, and its
outcome (created, 429 ``RateLimitException``, or another error, named). The SDK retries a
429 by itself (3 times, honouring ``Retry-After``); ``--sdk-retries`` (default 0) turns that
off so every 429 the node answers is counted here. Each created sandbox then runs
``commands.run("true")``, 8 at a time (``answered``: it is usable, not only listed), and all
are killed before the next round.

``--compare`` runs the same bursts on a second server started with ``AENV_START_QUEUE=0``:
no queue, the node's behaviour before issue 21 (``--max-starting`` creates start, the rest
get 429 at once). ``--max-starting`` and ``--max-sandboxes`` pass through to the servers.

Per round, ``split``: where each created sandbox's start went, read from the server's log
line for it (``aenv.api.views.log_start``): ``host`` (API, store, slot, VMM, state load:
what a KVM host pays in full), ``guest`` (the guest's own execution, envd's ``/init``: what
TCG slows) and ``queue`` (waiting behind the start limit), per create and summed.

Output: one JSON object, milliseconds; ``latency_ms`` has n, p50, p99 (null below 100
samples: use ``--rounds 2`` for 128), max. ``goal``: all ``--n`` created and answered within
10 s (issue 21, for 64). The host has 2 shared cores, guests run under TCG, and other
sessions' VMs may run at the same time: compare runs, not single numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from benchmarks._common import emit, summary
from benchmarks._server import VMServer, log

GOAL_S = 10.0


async def one_burst(n: int, retries: int) -> dict[str, Any]:
    from e2b import AsyncSandbox
    from e2b.exceptions import RateLimitException

    t0 = time.perf_counter()

    async def create() -> tuple[str, float, AsyncSandbox | None, str]:
        try:
            sbx = await AsyncSandbox.create("base", timeout=600, retries=retries)
            return "created", (time.perf_counter() - t0) * 1000, sbx, ""
        except RateLimitException as e:
            return "429", (time.perf_counter() - t0) * 1000, None, str(e)[:200]
        except Exception as e:  # named in the output, the burst goes on
            return "error", (time.perf_counter() - t0) * 1000, None, \
                f"{type(e).__name__}: {str(e)[:200]}"

    results = await asyncio.gather(*(create() for _ in range(n)))
    made = [r[2] for r in results if r[2] is not None]

    # Usable, not only listed; 8 at a time: a guest's first command after a restore runs
    # code TCG has not translated yet, and 64 of them at once on 2 cores measure contention.
    gate = asyncio.Semaphore(8)

    async def answers(sbx: AsyncSandbox) -> bool:
        async with gate:
            try:
                return (await sbx.commands.run("true", request_timeout=60)).exit_code == 0
            except Exception as e:
                log(f"{sbx.sandbox_id}: commands.run failed: {type(e).__name__}: {e}")
                return False

    ids = [s.sandbox_id for s in made]
    answered = await asyncio.gather(*(answers(s) for s in made))
    await asyncio.gather(*(s.kill() for s in made), return_exceptions=True)
    outcomes = Counter(r[0] for r in results)
    created_ms = [r[1] for r in results if r[0] == "created"]
    return {
        "outcomes": dict(outcomes),
        "ids": ids,
        "answered": sum(answered),
        "created_ms": created_ms,
        "refused_ms": [r[1] for r in results if r[0] == "429"],
        "all_ms": [r[1] for r in results],
        "errors": sorted({r[3] for r in results if r[0] == "error"})[:5],
        "refusals": sorted({r[3] for r in results if r[0] == "429"})[:3],
    }


# The server's line per start (aenv.api.views.log_start).
STARTED = re.compile(r"sandbox (\S+): started in ([\d.]+) ms \(host ([\d.]+) ms, guest "
                     r"([\d.]+) ms, queue ([\d.]+) ms\)")


def split(log_text: str, ids: list[str]) -> dict[str, Any]:
    """Where the created sandboxes' starts went, from the server's log: the host's work
    (what a KVM host pays in full), the guest's execution (TCG-bound) and the queue, each
    as a summary per create and as a sum over the burst."""
    want = set(ids)
    rows = [tuple(float(x) for x in m.groups()[1:]) for m in STARTED.finditer(log_text)
            if m.group(1) in want]
    out: dict[str, Any] = {"n": len(rows)}
    for i, name in enumerate(("total", "host", "guest", "queue")):
        values = [r[i] for r in rows]
        out[f"{name}_ms"] = summary(values)
        out[f"{name}_sum_s"] = round(sum(values) / 1000, 2)
    return out


def run_server(label: str, home: Path, net: int, args: argparse.Namespace,
               env: dict[str, str]) -> dict[str, Any]:
    server_args = ("--max-starting", str(args.max_starting),
                   "--max-sandboxes", str(args.max_sandboxes))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # VMServer passes the environment on to the server
    srv = VMServer(home, net, Settings.from_env().artifacts, server_args=server_args)
    rounds: list[dict[str, Any]] = []
    try:
        log(f"[{label}] starting aenv server (prefix {srv.settings.name_prefix}, {env})")
        srv.start()
        key = (srv.settings.secrets_dir / "api-key").read_text().strip()
        os.environ.update({"E2B_API_KEY": key, "E2B_API_URL": srv.url,
                           "E2B_SANDBOX_URL": srv.url, "E2B_DOMAIN": "localhost"})
        for i in range(args.rounds):
            r = asyncio.run(one_burst(args.n, args.sdk_retries))
            r["split"] = split(srv.log_path.read_text(errors="replace"), r.pop("ids"))
            rounds.append(r)
            log(f"[{label}] round {i + 1}/{args.rounds}: {r['outcomes']}, answered "
                f"{r['answered']}, slowest {max(r['all_ms']):.0f} ms")
    except BaseException:
        if srv.log_path.exists():
            log("server log tail:\n" + srv.log_path.read_text(errors="replace")[-3000:])
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        srv.shut_down()
    total = Counter[str]()
    for r in rounds:
        total.update(r["outcomes"])
    created = [x for r in rounds for x in r["created_ms"]]
    every = [x for r in rounds for x in r["all_ms"]]
    all_ok = all(r["outcomes"].get("created", 0) == args.n and r["answered"] == args.n
                 for r in rounds)
    return {
        "outcomes": dict(total),
        "answered": sum(r["answered"] for r in rounds),
        "latency_ms": summary(created),
        "refused_latency_ms": summary([x for r in rounds for x in r["refused_ms"]]),
        "slowest_answer_ms": round(max(every), 1) if every else None,
        "per_round": [{"outcomes": r["outcomes"], "answered": r["answered"],
                       "slowest_ms": round(max(r["all_ms"]), 1), "split": r["split"]}
                      for r in rounds],
        "errors": sorted({e for r in rounds for e in r["errors"]})[:5],
        "refusals": sorted({e for r in rounds for e in r["refusals"]})[:3],
        "goal_met": all_ok and bool(every) and max(every) <= GOAL_S * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="creates per burst")
    ap.add_argument("--rounds", type=int, default=1, help="bursts, one after another")
    ap.add_argument("--net", type=int, default=129,
                    help="second octet of the servers' host and veth /24s (one server at a "
                         "time)")
    ap.add_argument("--max-starting", type=int, default=8)
    ap.add_argument("--max-sandboxes", type=int, default=128)
    ap.add_argument("--sdk-retries", type=int, default=0,
                    help="the SDK's own retries of a 429 (its default is 3)")
    ap.add_argument("--compare", action="store_true",
                    help="also run the bursts on a server without the start queue")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("burst.py needs root (network namespaces, VMs)")
    result: dict[str, Any] = {
        "benchmark": "burst", "n": args.n, "rounds": args.rounds,
        "max_starting": args.max_starting, "sdk_retries": args.sdk_retries,
        "goal": f"all {args.n} created and answering within {GOAL_S:g} s",
        "load_before": os.getloadavg()}
    result["queued"] = run_server(
        "queue", Path(tempfile.mkdtemp(prefix="aenv-bench-burst-")), args.net, args, {})
    if args.compare:
        result["no_queue"] = run_server(
            "no queue", Path(tempfile.mkdtemp(prefix="aenv-bench-burst-")), args.net,
            args, {"AENV_START_QUEUE": "0"})
    result["load_after"] = os.getloadavg()
    emit(result)


if __name__ == "__main__":
    main()
