"""References that garbage collection must keep although no record names them yet.

A snapshot or layer is a GC root when a record of the store names it. Between the moment
an operation starts writing one (or starts restoring from one) and the moment a record
points at it, only the operation knows it is in use: a pause's snapshot before the record
says ``paused``, a build's template image before the template is updated, the template
image a create is restoring from while that template is deleted, a fork's capture while
its source is killed. Such operations hold a pin for that window; ``Orchestrator.gc_roots``
adds every held pin, and the machines compute the roots under the same lock that
serialises snapshot writes, so a collection never sees a state older than its deletes.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator


class Pins:
    """A multiset of pinned references (two operations may pin the same one)."""

    def __init__(self) -> None:
        self._held: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, *refs: str | None) -> Iterator[None]:
        """Keep ``refs`` (None entries are ignored) alive for the duration of the block."""
        held = [r for r in refs if r]
        self._held.update(held)
        try:
            yield
        finally:
            self._held.subtract(held)
            for r in held:
                if self._held[r] <= 0:
                    del self._held[r]

    def held(self) -> set[str]:
        return set(self._held)
