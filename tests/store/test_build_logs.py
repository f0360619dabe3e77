"""A build's log in the store stays bounded however much the build prints, and the E2B
SDK's way of polling it (``logsOffset`` += the entries it got, 100 per call, until a
finished build answers none) reads every kept line exactly once, in order."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from aenv.store import BuildRecord, Database, TemplateRecord, TemplateStore
from aenv.store.templates import LogLimits

PAGE = 100  # what the API hands the SDK per call


@pytest.fixture
def db(tmp_path: Path):
    d = Database(tmp_path / "aenv.db")
    yield d
    d.close()


def _store(db: Database, limits: LogLimits | None = None) -> TemplateStore:
    s = TemplateStore(db, log_limits=limits) if limits else TemplateStore(db)
    now = time.time()
    s.insert(TemplateRecord(id="t", kind="template", build_id="b", status="building",
                            cpu_count=1, memory_mb=512, disk_size_mb=1024, created_at=now,
                            updated_at=now))
    s.insert_build(BuildRecord(id="b", template_id="t", status="building", created_at=now))
    return s


def _rows_and_bytes(db: Database) -> tuple[int, int]:
    n, size = db.query("SELECT COUNT(*), COALESCE(SUM(length(CAST(message AS BLOB))), 0) "
                       "FROM build_logs WHERE build_id = 'b'")[0]
    return n, size


def _all(store: TemplateStore) -> list[str]:
    return [e["message"] for e in store.logs("b", 0, 10**9)]


class SdkPoller:
    """What e2b's ``wait_for_build_finish`` does with the status endpoint."""

    def __init__(self, store: TemplateStore) -> None:
        self.store, self.offset, self.seen = store, 0, []

    def poll(self) -> int:
        got = self.store.logs("b", self.offset, PAGE)
        self.offset += len(got)
        self.seen += [e["message"] for e in got]
        return len(got)

    def drain(self) -> None:
        while self.poll():
            pass


@pytest.mark.slow
def test_a_200k_line_build_log_stays_bounded_in_rows_and_bytes(db) -> None:
    store = _store(db)
    limits = LogLimits()
    for i in range(200_000):
        store.append_log("b", f"line {i:06d} " + "x" * 60, step="1")
        if i == 150_000:
            rows, size = _rows_and_bytes(db)
            assert rows <= limits.head_lines + limits.tail_lines + 1
            assert size <= limits.head_bytes + limits.tail_bytes + 1024
    store.update_build("b", status="error", reason="boom")

    rows, size = _rows_and_bytes(db)
    assert rows <= limits.head_lines + limits.tail_lines + 2
    assert size <= limits.head_bytes + limits.tail_bytes + 1024
    shown = _all(store)
    assert len(shown) == rows, "every stored line is visible once the build ended"
    assert shown[0] == "line 000000 " + "x" * 60
    assert shown[-1] == "line 199999 " + "x" * 60, "the tail is kept"
    tail = [m for m in shown if m.startswith("line ")][-100:]
    assert tail == [f"line {i:06d} " + "x" * 60 for i in range(199_900, 200_000)]
    dropped = [m for m in shown if "dropped" in m]
    assert len(dropped) == 1
    kept = sum(m.startswith("line ") for m in shown)
    assert f"{200_000 - kept} lines" in dropped[0]


def test_a_line_longer_than_the_limit_is_cut_and_says_so(db) -> None:
    store = _store(db, LogLimits(line_bytes=1000))
    store.append_log("b", "é" * 5000)  # 10000 bytes of UTF-8
    (msg,) = _all(store)
    assert len(msg.encode()) <= 1000
    assert msg.startswith("é" * 400) and "bytes cut" in msg


def test_the_newest_lines_are_kept_by_bytes_as_well_as_by_count(db) -> None:
    store = _store(db, LogLimits(head_lines=10, head_bytes=10_000, tail_lines=1000,
                                 tail_bytes=5_000))
    for i in range(500):
        store.append_log("b", f"{i:04d}" + "y" * 96)  # 100 bytes each
    store.update_build("b", status="ready")
    shown = _all(store)
    assert shown[:10] == [f"{i:04d}" + "y" * 96 for i in range(10)]
    assert shown[-50:] == [f"{i:04d}" + "y" * 96 for i in range(450, 500)]
    assert len(shown) == 10 + 1 + 1 + 50  # head, notice, dropped marker, 5000 bytes of tail


def test_sdk_polling_reads_each_kept_line_once_even_when_it_falls_behind(db) -> None:
    store = _store(db, LogLimits(head_lines=250, tail_lines=300))
    sdk = SdkPoller(store)
    written = 0
    for burst in (30, 500, 7, 5000, 1):  # the SDK reads one page between bursts
        for _ in range(burst):
            store.append_log("b", f"out {written}")
            written += 1
        sdk.poll()
    store.append_log("b", "the command failed", level="error")
    store.update_build("b", status="error", reason="the command failed")
    store.append_log("b", "after the end")
    sdk.drain()

    assert sdk.seen == _all(store), "nothing repeated, nothing skipped"
    lines = [m for m in sdk.seen if m.startswith("out ")]
    assert lines[:250] == [f"out {i}" for i in range(250)]
    assert lines[250:] == [f"out {i}" for i in range(written - 299, written)]
    assert sdk.seen[-2:] == ["the command failed", "after the end"]
    assert sum("dropped" in m for m in sdk.seen) == 1


def test_offsets_already_read_keep_their_lines(db) -> None:
    store = _store(db, LogLimits(head_lines=5, tail_lines=3))
    for i in range(5):
        store.append_log("b", f"l{i}")
    before = store.logs("b", 2, PAGE)
    for i in range(5, 50):
        store.append_log("b", f"l{i}")
    assert store.logs("b", 2, PAGE)[:3] == before
    store.update_build("b", status="ready")
    assert store.logs("b", 2, PAGE)[:3] == before
    assert [e["seq"] for e in store.logs("b", 0, PAGE)] == list(range(len(_all(store))))


def test_a_log_under_the_limits_is_stored_as_written(db) -> None:
    store = _store(db)
    for i in range(1000):
        store.append_log("b", f"l{i}", level="info" if i % 2 else "warn", step=str(i % 3))
    store.update_build("b", status="ready")
    got = store.logs("b", 0, 2000)
    assert [e["message"] for e in got] == [f"l{i}" for i in range(1000)]
    assert got[3]["level"] == "info" and got[4]["level"] == "warn" and got[5]["step"] == "2"
