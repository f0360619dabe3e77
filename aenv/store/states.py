"""The lifecycle as types: sandbox states, template kinds, build statuses, and the one table
of state changes a sandbox may make.

The values are the strings the store holds and the logs print (``str`` enums: a member
equals, hashes and formats as its value), so nothing stored or shown changes with them.
The orchestrator decides when a sandbox changes state; ``TRANSITIONS`` says which changes
can happen at all, and ``SandboxStore.transition`` refuses any other with
``IllegalTransition`` before it writes: that is a bug in the caller, never a client's
mistake. ``docs/architecture.md`` draws the same table, and a test holds the two equal.

Which states count for what (``LIVE_STATES``, ``VM_STATES``) is decided here too, so the
store's queries, admission and the API's views cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from types import MappingProxyType


class SandboxState(StrEnum):
    """Where a sandbox is in its life (the ``state`` column of ``sandboxes``)."""

    CREATING = "creating"  # inserted; its VM is booting or restoring
    RUNNING = "running"
    PAUSING = "pausing"  # its snapshot is being written (``snapshot_id`` names it)
    PAUSED = "paused"  # no VM; resumes from ``snapshot_id``
    RESUMING = "resuming"
    SNAPSHOTTING = "snapshotting"  # a persistent snapshot's capture of a running sandbox
    FORKING = "forking"  # the capture a fork's children restore from
    KILLING = "killing"
    KILLED = "killed"  # ended: kept as history until ``Limits.retention_s``
    LOST = "lost"  # ended: its VM vanished (a crash, a failed pause)
    # The VM of a template build or a template's snapshot: an in-memory record the
    # machines are handed, never stored, so it makes no transitions.
    BUILDING = "building"


class TemplateKind(StrEnum):
    """What a ``templates`` row is: a built template, or a sandbox's persistent snapshot
    (E2B keeps both in one catalogue)."""

    TEMPLATE = "template"
    SNAPSHOT = "snapshot"


class BuildStatus(StrEnum):
    """The ``status`` of a build, and of a template (which shows its builds' until its
    first is ready, and stays ``ready`` from then on)."""

    WAITING = "waiting"  # reserved, not started
    BUILDING = "building"
    READY = "ready"
    ERROR = "error"


S = SandboxState

# from-state → the states it may change to. Every ``transition`` call in the orchestrator
# is one of these arrows (docs/architecture.md, "Lifecycle", names the call for each).
TRANSITIONS: Mapping[SandboxState, frozenset[SandboxState]] = MappingProxyType({
    S.CREATING: frozenset({S.RUNNING, S.KILLING, S.KILLED, S.LOST}),
    S.RUNNING: frozenset({S.RUNNING, S.PAUSING, S.SNAPSHOTTING, S.FORKING, S.KILLING, S.LOST}),
    S.PAUSING: frozenset({S.PAUSED, S.RUNNING, S.KILLING, S.LOST}),
    S.PAUSED: frozenset({S.RESUMING, S.KILLING}),
    S.RESUMING: frozenset({S.RUNNING, S.PAUSED, S.KILLING, S.LOST}),
    S.SNAPSHOTTING: frozenset({S.RUNNING, S.KILLING, S.LOST}),
    S.FORKING: frozenset({S.RUNNING, S.KILLING, S.LOST}),
    S.KILLING: frozenset({S.KILLING, S.KILLED}),
    S.KILLED: frozenset({S.KILLED}),
    S.LOST: frozenset(),
    S.BUILDING: frozenset(),
})

# A sandbox that ended; the row stays as history.
ENDED_STATES: tuple[SandboxState, ...] = (S.KILLED, S.LOST)
# States in which a sandbox exists for the API (the rest are history, or never stored).
LIVE_STATES: tuple[SandboxState, ...] = tuple(
    s for s in SandboxState if s not in ENDED_STATES and s is not S.BUILDING)
# States in which a sandbox holds a VM (or is getting one): what admission counts.
VM_STATES: tuple[SandboxState, ...] = tuple(
    s for s in LIVE_STATES if s not in (S.PAUSED, S.KILLING))
# Build statuses after which nothing more happens to the build.
BUILD_ENDED: tuple[BuildStatus, ...] = (BuildStatus.READY, BuildStatus.ERROR)

del S


class IllegalTransition(RuntimeError):
    """A state change ``TRANSITIONS`` does not allow was asked for: a programming error in
    the caller, not a client's (the API answers it 500, as any unexpected exception)."""

    def __init__(self, sandbox_id: str, from_state: str, to_state: str) -> None:
        super().__init__(f"sandbox {sandbox_id}: {from_state} -> {to_state} is not a "
                         "transition of the lifecycle")
        self.sandbox_id, self.from_state, self.to_state = sandbox_id, from_state, to_state


def _as_state(value: str) -> SandboxState | None:
    try:
        return SandboxState(value)
    except ValueError:
        return None


def check_transition(sandbox_id: str, from_states: Iterable[str], to_state: str
                     ) -> tuple[tuple[SandboxState, ...], SandboxState]:
    """``from_states`` and ``to_state`` as states when every ``from -> to`` is in
    ``TRANSITIONS``; else ``IllegalTransition`` (a name that is no state is in none)."""
    to = _as_state(to_state)
    if to is None:
        raise IllegalTransition(sandbox_id, ",".join(from_states), to_state)
    states = []
    for s in from_states:
        frm = _as_state(s)
        if frm is None or to not in TRANSITIONS[frm]:
            raise IllegalTransition(sandbox_id, s, to)
        states.append(frm)
    return tuple(states), to
