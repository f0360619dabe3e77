"""doctor_checks reports what network slots need."""

from __future__ import annotations

from aenv.network import doctor_checks


def test_doctor_reports_nftables_and_ip_forward():
    rows = dict(doctor_checks())
    assert {"nftables", "ip_forward", "/dev/net/tun", "network privileges"} <= rows.keys()
    assert rows["ip_forward"] in ("on", "off (aenv turns it on when it starts)")
