"""benchmarks/cluster_list.py and benchmarks/cluster_create_rate.py, tiny: each runs to
its end, prints its one JSON object with the figures it promises, and leaves no process
behind (its redis-server, nodes and gateway are stopped)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow]


def run(script: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def no_children_left(marker: str) -> bool:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return not any(marker in line for line in ps.splitlines())


def test_cluster_list_pages_every_indexed_sandbox() -> None:
    out = run("cluster_list.py", "--sandboxes", "60", "--n", "5", "--walks", "2",
              "--warmup", "1")
    assert out["indexed"] == 60 and out["nodes"] == 3 and "fake nodes" in out["method"]
    for key in ("first_page_ms", "first_page_direct_ms", "one_page_of_1000_ms"):
        assert out[key]["n"] == 5 and out[key]["p50"] > 0
    assert out["all_pages_ms"]["pages"] == 1
    assert no_children_left("aenv-bench-cluster-list-")


def test_cluster_create_rate_compares_two_nodes_with_one() -> None:
    out = run("cluster_create_rate.py", "--creates", "12", "--rounds", "1",
              "--concurrency", "4", "--start-ms", "20")
    for key in ("direct_one_node", "gateway_two_nodes", "gateway_one_node"):
        assert out[key]["median_per_s"] > 0 and out[key]["create_ms"]["n"] == 12
    assert out["two_nodes_over_one_direct"] > 0
    assert no_children_left("aenv-bench-cluster-rate-")
