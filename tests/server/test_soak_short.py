"""The soak of ``benchmarks/soak.py``, short: ten pause/resume, snapshot and fork cycles of
one sandbox running the checksummed writer, on the session's server. Every state read
must check out, no operation may fail, and the audit (host and home against the database)
must find nothing that no record accounts for."""

from __future__ import annotations

import pytest

from benchmarks.soak import run_soak

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(300)]

KNOWN_LEAKS: tuple[str, ...] = ()  # none known


@pytest.fixture(scope="module")
def soak(live_server) -> dict:
    assert live_server.proc is not None
    return run_soak(live_server, 10, seed=7, audit_every=5, server_pid=live_server.proc.pid)


def test_ten_cycles_keep_counter_checksum_and_fork_lineage(soak) -> None:
    assert soak["cycles_done"] == 10
    assert set(soak["operations"]) >= {"pause_resume", "snapshot", "fork"}
    assert soak["mismatches"] == 0, soak["mismatch_details"]
    assert soak["errors"] == 0, soak["error_details"]


def test_ten_cycles_leak_no_record_process_slot_or_file(soak) -> None:
    leaks = {k: v for k, v in soak["leaks"].items() if k not in KNOWN_LEAKS}
    assert leaks == {}
    assert not any(a["problems"].get(k) for a in soak["audits"] for k in a["problems"]
                   if k not in KNOWN_LEAKS), soak["audits"]


def test_the_overlay_cache_keeps_no_overlay_of_a_deleted_snapshot(soak) -> None:
    assert soak["leaks"].get("overlay_cache_dangling", []) == []


def test_collection_keeps_only_what_the_live_lineage_reads(soak) -> None:
    held = [soak["retention_before_final_kill"]["retained_unneeded"],
            *(a["problems"].get("snapshots_retained_unneeded", 0) for a in soak["audits"])]
    assert max(held) == 0
