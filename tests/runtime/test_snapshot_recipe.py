"""The snapshot recipe (``aenv.runtime.snapshot_recipe``) with stand-in steps: the order of
the steps, what ``SnapshotInfo`` reports, the undo stack on a failure, and the one error
translation. No VM; the drivers' steps run against real VMMs in test_snapshot.py,
test_snapshot_failures.py and (a fake Firecracker) test_firecracker_driver.py."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from aenv.runtime import NotSupportedError, SnapshotError, VMExitedError
from aenv.runtime import snapshot_recipe as recipe
from aenv.runtime import workdir as wd
from aenv.runtime.snapshot_recipe import Capture, Captured, CaptureSteps, Undo
from aenv.storage.errors import StorageError

STEPS = ("plan", "freeze", "save_state", "save_memory", "drives", "thaw", "commit", "finish")


class Steps(CaptureSteps):
    """Records every step and undo; ``fail`` names a step that raises ``error``."""

    def __init__(self, workdir: Path, *, fail: str | None = None,
                 error: BaseException | None = None, dies: bool = False) -> None:
        self.vm_id = "vm1"
        self.workdir = workdir
        self.fail, self.error, self.dies = fail, error, dies
        self.alive = True
        self.log: list[str] = []

    def is_alive(self) -> bool:
        return self.alive

    async def _step(self, name: str, c: Capture) -> None:
        self.log.append(name)
        if name == self.fail:
            if self.dies:
                self.alive = False
            raise self.error or OSError(28, "No space left on device")

    async def plan(self, c: Capture) -> None:
        c.undo.push("the staging directory", lambda: self.log.append("undo staging"))
        await self._step("plan", c)

    async def freeze(self, c: Capture) -> None:
        async def unfreeze() -> None:
            self.log.append("undo freeze")

        c.undo.push("the freeze", unfreeze)
        await asyncio.sleep(0.01)
        await self._step("freeze", c)

    async def save_state(self, c: Capture) -> None:
        await self._step("save_state", c)

    async def save_memory(self, c: Capture) -> None:
        await self._step("save_memory", c)

    async def drives(self, c: Capture) -> None:
        await self._step("drives", c)

    async def thaw(self, c: Capture) -> None:
        await self._step("thaw", c)
        if not c.stop:
            c.undo.drop("the freeze")

    async def commit(self, c: Capture) -> Captured:
        await self._step("commit", c)
        return Captured(parent=None, memory_bytes=4096, memory_layers=1, disk_bytes=8192,
                        compacted=False, method="full")

    async def finish(self, c: Capture) -> None:
        if c.stop:
            c.vmm_stopped = True
            self.alive = False
            await asyncio.sleep(0.01)
            c.frozen_until_finish = True  # frozen until the VMM is gone
        await self._step("finish", c)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / wd.VMM_LOG).write_text("qemu: the last thing it said\n")
    return tmp_path


async def test_the_steps_run_in_the_recipes_order_and_report_what_commit_made(workdir) -> None:
    steps = Steps(workdir)
    info = await recipe.capture(steps, workdir / "snap", stop=False, incremental=True)
    assert steps.log == list(STEPS)
    assert (info.directory, info.memory_bytes, info.memory_layers, info.disk_bytes) == \
        (workdir / "snap", 4096, 1, 8192)
    assert list(info.phases) == list(STEPS)  # the recipe times each step, by its name
    assert info.phases["freeze"] >= 0.01  # the freeze's sleep is in its own step
    assert all(v >= 0 for v in info.phases.values())
    assert info.freeze_s == pytest.approx(sum(info.phases[s] for s in STEPS[1:6]))
    assert 0 < info.freeze_s < info.total_s


async def test_a_step_may_keep_the_vm_frozen_past_the_thaw(workdir) -> None:
    info = await recipe.capture(Steps(workdir), workdir / "s", stop=True, incremental=True)
    assert info.freeze_s >= 0.02  # the freeze's sleep and the stop's
    assert info.phases["finish"] >= 0.01


@pytest.mark.parametrize("step", ["plan", "freeze", "save_state", "save_memory", "drives",
                                  "thaw"])
async def test_a_failed_step_unwinds_the_undo_stack_newest_first(workdir, step) -> None:
    steps = Steps(workdir, fail=step)
    with pytest.raises(SnapshotError) as err:
        await recipe.capture(steps, workdir / "s", stop=False, incremental=True)
    done = steps.log[:steps.log.index(step) + 1]
    undone = steps.log[len(done):]
    assert done == list(STEPS[:STEPS.index(step) + 1])
    assert undone == (["undo staging"] if step == "plan" else ["undo freeze", "undo staging"])
    e = err.value
    assert isinstance(e.__cause__, OSError) and "No space left" in str(e)
    assert e.vm_id == "vm1" and e.vm_lost is False
    assert "the last thing it said" in e.vmm_log_tail


async def test_after_the_thaw_a_failure_does_not_thaw_again(workdir) -> None:
    steps = Steps(workdir, fail="commit")
    with pytest.raises(SnapshotError):
        await recipe.capture(steps, workdir / "s", stop=False, incremental=True)
    assert steps.log[-2:] == ["commit", "undo staging"]


async def test_a_pause_that_fails_before_its_commit_is_thawed(workdir) -> None:
    steps = Steps(workdir, fail="commit")
    with pytest.raises(SnapshotError) as err:
        await recipe.capture(steps, workdir / "s", stop=True, incremental=True)
    assert steps.log[-3:] == ["commit", "undo freeze", "undo staging"]
    assert err.value.vm_lost is False


async def test_after_the_commit_nothing_is_undone_and_a_stopped_vmm_is_lost(workdir) -> None:
    steps = Steps(workdir, fail="finish", error=VMExitedError("gone", vm_id="vm1"))
    with pytest.raises(SnapshotError) as err:
        await recipe.capture(steps, workdir / "s", stop=True, incremental=True)
    assert steps.log[-1] == "finish"  # no undo ran
    assert err.value.vm_lost is True


async def test_a_vmm_that_died_during_the_capture_is_lost(workdir) -> None:
    steps = Steps(workdir, fail="save_state", error=VMExitedError("exited", vm_id="vm1"),
                  dies=True)
    with pytest.raises(SnapshotError) as err:
        await recipe.capture(steps, workdir / "s", stop=False, incremental=True)
    assert err.value.vm_lost is True and isinstance(err.value.__cause__, VMExitedError)


@pytest.mark.parametrize("error", [
    SnapshotError("restored, but its snapshot is gone"),
    NotSupportedError("a raw drive needs reflink", vm_id="vm1"),
])
async def test_snapshot_and_not_supported_errors_pass_as_they_are(workdir, error) -> None:
    steps = Steps(workdir, fail="drives", error=error)
    with pytest.raises(type(error)) as err:
        await recipe.capture(steps, workdir / "s", stop=False, incremental=True)
    assert err.value is error and err.value.vm_id == "vm1"
    assert steps.log[-2:] == ["undo freeze", "undo staging"]


@pytest.mark.parametrize("error", [StorageError("disk full"), KeyError("bug")])
async def test_every_other_exception_is_a_snapshot_error_chained_to_it(workdir, error) -> None:
    with pytest.raises(SnapshotError) as err:
        await recipe.capture(Steps(workdir, fail="save_memory", error=error), workdir / "s",
                             stop=False, incremental=True)
    assert err.value.__cause__ is error


async def test_a_cancelled_capture_unwinds_and_stays_a_cancellation(workdir) -> None:
    steps = Steps(workdir, fail="drives", error=asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        await recipe.capture(steps, workdir / "s", stop=False, incremental=True)
    assert steps.log[-2:] == ["undo freeze", "undo staging"]


async def test_a_failing_undo_is_logged_and_the_rest_still_run(caplog) -> None:
    ran: list[str] = []
    undo = Undo("vm1")
    undo.push("first", lambda: ran.append("first"))

    def broken() -> None:
        raise OSError("cannot")

    undo.push("second", broken)
    with caplog.at_level(logging.WARNING, logger="aenv.runtime"):
        await undo.unwind()
    assert ran == ["first"] and "undoing second failed: cannot" in caplog.text
    assert "first" not in undo


def test_dropping_an_undo_forgets_the_latest_of_that_name() -> None:
    undo = Undo("vm1")
    undo.push("a", lambda: None)
    undo.push("b", lambda: None)
    undo.drop("a")
    assert "a" not in undo and "b" in undo
    with pytest.raises(KeyError):
        undo.drop("a")
