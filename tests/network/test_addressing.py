"""Names and addresses of slots are pure arithmetic on Settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.network.addressing import Addressing


def _a(**kw) -> Addressing:
    return Addressing(Settings(home=Path("/nonexistent"), **kw))


def test_default_slot_names_and_addresses():
    s = _a().slot(5)
    assert (s.netns, s.host_veth) == ("aenv-ns-5", "aenv-v5")
    assert s.host_ip == "10.11.0.5"
    assert (s.veth_host_ip, s.veth_ns_ip) == ("10.12.0.10", "10.12.0.11")


def test_capacity_is_bounded_by_the_veth_range():
    assert _a().capacity == 32767
    assert _a().slot(32767).veth_ns_ip == "10.12.255.255"
    with pytest.raises(ValueError):
        _a().slot(32768)
    with pytest.raises(ValueError):
        _a().slot(0)


def test_prefix_must_leave_room_in_interface_names():
    with pytest.raises(ValueError, match="too long"):
        _a(name_prefix="muchtoolong")
    assert _a(name_prefix="abcdefgh").slot(32767).host_veth == "abcdefgh-v32767"


def test_overlapping_ranges_are_refused():
    with pytest.raises(ValueError, match="overlaps"):
        _a(host_cidr="10.11.0.0/16", veth_cidr="10.11.128.0/17")


def test_only_exact_names_are_recognised_as_ours():
    a = _a()
    assert a.index_of_netns("aenv-ns-12") == 12
    assert a.index_of_veth("aenv-v12") == 12
    for name in ("aenv-ns-x", "aenvx-ns-1", "aenv-ns-01", "aenv-ns-", "xaenv-ns-1"):
        assert a.index_of_netns(name) is None
    for name in ("aenv-vx", "aenv-v0", "aenvb-v1", "aenv-veth1"):
        assert a.index_of_veth(name) is None
    assert a.owns_table("aenv") and a.owns_table("aenv-extra")
    assert not a.owns_table("aenvx") and not a.owns_table("filter")
