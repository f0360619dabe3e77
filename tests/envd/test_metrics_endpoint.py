"""envd's ``GET /metrics``: what the orchestrator polls, answered past Starlette but behind
the access-token check."""

from __future__ import annotations

import httpx


def test_metrics_answers_a_sample_with_the_token(envd, control_plane, access_token):
    r = httpx.get(envd.url + "/metrics", headers={"X-Access-Token": access_token})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    m = r.json()
    assert m["cpu_count"] >= 1 and 0 <= m["cpu_used_pct"] <= 100
    assert 0 < m["mem_used"] <= m["mem_total"] and 0 < m["mem_cache"] <= m["mem_total"]
    assert 0 < m["disk_used"] <= m["disk_total"] and m["ts"] > 1_700_000_000


def test_metrics_without_the_token_is_401(envd, control_plane):
    assert httpx.get(envd.url + "/metrics").status_code == 401
    r = httpx.get(envd.url + "/metrics", headers={"X-Access-Token": "wrong"})
    assert r.status_code == 401


def test_other_methods_on_metrics_are_405(envd, control_plane, access_token):
    r = httpx.post(envd.url + "/metrics", headers={"X-Access-Token": access_token})
    assert r.status_code == 405
