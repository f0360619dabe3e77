"""``serving()`` sweeps a prefix's leftovers only while no other live server holds the
prefix: a test server that could not start because another (a concurrent pytest's session
server) had its prefix must not remove that server's namespaces. No VM: the second server
is refused at start."""

from __future__ import annotations

import os
import subprocess

import pytest

from aenv.instance_lock import claim_instance
from tests.server.conftest import ServerProcess, serving

pytestmark = [pytest.mark.net]

PREFIX = "aenvsg"


@pytest.fixture
def other_servers_netns():
    """A namespace of ``PREFIX`` as a live server would have it; removed at the end."""
    name = f"{PREFIX}-ns-1"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield name
    subprocess.run(["ip", "netns", "del", name], check=False)


def test_a_server_refused_for_a_held_prefix_sweeps_nothing(tmp_path, other_servers_netns
                                                          ) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    holder = ServerProcess(tmp_path / "holder", prefix=PREFIX, net=41)
    live = claim_instance(holder.settings)  # the live server's instance lock
    try:
        srv = ServerProcess(tmp_path / "refused", prefix=PREFIX, net=41)
        def must_not_sweep(_settings: object) -> None:
            pytest.fail("swept a live server's prefix")

        with (pytest.raises(pytest.fail.Exception, match="not sweeping prefix aenvsg"),
              serving(srv, cleanup=must_not_sweep)):
            pass
        assert other_servers_netns in os.listdir("/run/netns")
    finally:
        live.release()
