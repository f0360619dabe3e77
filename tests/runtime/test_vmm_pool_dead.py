"""A pooled VMM that died (``aenv.runtime.vmm_pool``), with a fake driver and no VM: the pool
discards it, counts it, and logs how it ended (exit status or signal, and how long after
it was made) with the tail of its log (QEMU's stderr), which the discard then deletes."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest

from aenv.runtime import workdir as wd
from aenv.runtime.base import RestoreOverrides
from aenv.runtime.vmm_pool import VMMPool, exit_description
from aenv.storage import snapshots as snap


@dataclass
class FakePre:
    vm_id: str
    workdir: Path
    returncode: int | None = None

    def is_alive(self) -> bool:
        return self.returncode is None


class FakeRuntime:
    def __init__(self) -> None:
        self.made: list[FakePre] = []
        self.discarded: list[str] = []

    async def prestart(self, snapshot_dir: Path, overrides: RestoreOverrides) -> FakePre:
        overrides.workdir.mkdir(parents=True)
        pre = FakePre(overrides.vm_id, overrides.workdir)
        self.made.append(pre)
        return pre

    async def activate(self, pre: FakePre) -> None:
        raise AssertionError("not activated here")

    async def discard(self, pre: FakePre) -> None:
        self.discarded.append(pre.vm_id)


@dataclass(frozen=True)
class Slot:
    netns: str = "ns"


def pool_of(tmp_path: Path, runtime: FakeRuntime) -> VMMPool[Slot]:
    async def acquire() -> Slot:
        return Slot()

    async def release(slot: Slot) -> None:
        return None

    (tmp_path / "vms").mkdir()
    return VMMPool(runtime, tmp_path / "vms", size=2, memory_mb=4096, acquire=acquire,
                   release=release, busy=lambda: False)


@pytest.fixture
def template(tmp_path: Path) -> Path:
    d = tmp_path / "template"
    d.mkdir()
    (d / snap.MANIFEST).write_text("{}")
    return d


def test_exit_statuses_read_as_words() -> None:
    assert exit_description(1) == "exit status 1"
    assert exit_description(-9) == "killed by SIGKILL"
    assert exit_description(None) == "exit status unknown"


async def test_a_dead_pooled_vmm_taken_is_logged_with_its_status_and_log_tail(
        tmp_path: Path, template: Path, caplog: pytest.LogCaptureFixture) -> None:
    runtime = FakeRuntime()
    pool = pool_of(tmp_path, runtime)
    entry = await pool.fill_one(template)
    pre: FakePre = entry.pre
    (pre.workdir / wd.VMM_LOG).write_text(
        "early line\n" * 20 + "qemu-system-x86_64: cannot set up guest memory 'mem'\n")
    pre.returncode = 1
    with caplog.at_level(logging.WARNING, logger="aenv.runtime"):
        assert await pool.take(template) is None
    (record,) = [r for r in caplog.records if "had exited" in r.getMessage()]
    message = record.getMessage()
    assert pre.vm_id in message and "exit status 1" in message
    assert "ms after it was pre-started" in message
    assert "cannot set up guest memory" in message
    assert message.count("early line") < 20          # a tail, not the whole log
    assert pool.stats["dead"] == 1 and runtime.discarded == [pre.vm_id]
    assert not pre.workdir.exists()                  # read before its directory went


async def test_a_dead_pooled_vmm_pruned_is_logged_too(
        tmp_path: Path, template: Path, caplog: pytest.LogCaptureFixture) -> None:
    runtime = FakeRuntime()
    pool = pool_of(tmp_path, runtime)
    entry = await pool.fill_one(template)
    entry.pre.returncode = -9                        # no log at all
    with caplog.at_level(logging.WARNING, logger="aenv.runtime"):
        assert await pool.prune() == 1
    (record,) = [r for r in caplog.records if "had exited" in r.getMessage()]
    assert "killed by SIGKILL" in record.getMessage()
    assert "(empty)" in record.getMessage()
    assert pool.stats["dead"] == 1
    await asyncio.sleep(0)
