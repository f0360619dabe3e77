"""``debian.closure``: what apt would add to a system that already has some packages."""

from __future__ import annotations

import shutil

import pytest

from aenv.storage import debian

# apt-get -s over the whole archive's lists: seconds each, so left out of make test-fast.
pytestmark = [pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt"),
              pytest.mark.slow]


def _known(name: str) -> bool:
    try:
        debian.candidate(name)
    except Exception:
        return False
    return True


def test_closure_leaves_out_what_is_there_beside() -> None:
    if not (_known("curl") and _known("libcurl4")):
        pytest.skip("apt's lists do not know curl here")
    alone = {p.name for p in debian.closure(["curl"])}
    beside = {p.name for p in debian.closure(["curl"], beside=["libcurl4"])}
    assert {"curl", "libcurl4", "libc6"} <= alone
    assert beside == {"curl"}
