"""Egress policies: validation, and the order their rules take in the slot table."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.network import DEFAULT_POLICY, EgressPolicy, PolicyError, rulesets
from aenv.network.addressing import Addressing


def test_entries_are_normalised_and_deduplicated():
    p = EgressPolicy.build(allow_out=["8.8.8.8", "10.1.2.3/8", "8.8.8.8/32"])
    assert p.allow_out == ("8.8.8.8/32", "10.0.0.0/8")


@pytest.mark.parametrize("entry", ["*", "exa mple.com", "-a.com", "2001:db8::/32",
                                   "10.0.0.0/33", ""])
def test_entries_that_are_not_ipv4_cidrs_or_names_are_refused(entry):
    with pytest.raises(PolicyError) as e:
        EgressPolicy.build(deny_out=[entry])
    assert e.value.entry == entry


def test_default_policy_adds_no_user_rules():
    assert DEFAULT_POLICY.is_default
    assert rulesets.policy_update(_addressing(), DEFAULT_POLICY).splitlines() == [
        "flush chain inet aenv egress_user",
        "add chain inet aenv egress_redirect "
        "{ type nat hook prerouting priority dstnat - 5; policy accept; }",
        "flush chain inet aenv egress_redirect"]


def _addressing() -> Addressing:
    return Addressing(Settings(home=Path("/nonexistent")))


def test_allow_comes_before_deny_and_deny_before_the_final_refusal():
    p = EgressPolicy.build(allow_out=["1.1.1.1"], deny_out=["1.0.0.0/8"], allow_internet=False)
    rules = [r for r in rulesets.policy_update(_addressing(), p).splitlines()[1:]
             if " egress_user " in r]
    assert [r.split()[-1] if "accept" in r else "reject" for r in rules] == \
        ["accept", "reject", "reject"]
    assert "1.1.1.1/32" in rules[0] and "1.0.0.0/8" in rules[1]
    assert rules[2].endswith("egress_user reject with icmpx type admin-prohibited")


def test_aenv_ranges_are_refused_before_user_rules_and_private_ones_after():
    a = _addressing()
    table = rulesets.slot_table(a, a.slot(1), DEFAULT_POLICY)
    egress = table[table.index("chain egress {"):]
    own = egress.index("10.11.0.0/16, 10.12.0.0/16")
    user = egress.index("jump egress_user")
    private = egress.index("192.168.0.0/16")
    assert own < user < private


def test_metadata_is_refused_with_aenvs_ranges_before_user_rules():
    a = _addressing()
    table = rulesets.slot_table(a, a.slot(1), EgressPolicy.build(allow_out=["0.0.0.0/0"]))
    egress = table[table.index("chain egress {"):]
    first = egress.splitlines()[1]
    assert "169.254.169.254/32" in first and "100.100.100.200/32" in first
    assert first.rstrip().endswith("reject with icmpx type admin-prohibited")
    assert egress.index("169.254.169.254/32") < egress.index("jump egress_user")


def test_the_host_table_refuses_metadata_and_named_addresses_of_the_host():
    table = rulesets.host_table(_addressing(), ["192.0.2.1/32", "198.51.100.0/24"])
    refused = table[table.index("set refused {"):table.index("chain prerouting")]
    for cidr in ("169.254.169.254/32", "192.0.2.1/32", "198.51.100.0/24"):
        assert cidr in refused
    assert 'iifname "aenv-v*" ip daddr @refused reject' in table


def test_dns_servers_default_to_8_8_8_8_and_may_be_none():
    assert EgressPolicy.build().dns_servers == ("8.8.8.8",)
    assert EgressPolicy.build(dns_servers=[]).dns_servers == ()
    assert EgressPolicy.build(dns_servers=["1.1.1.1", "1.1.1.1"]).dns_servers == ("1.1.1.1",)
    with pytest.raises(PolicyError):
        EgressPolicy.build(dns_servers=["dns.example.com"])


def test_dns_servers_open_port_53_only_when_allow_out_names_a_domain():
    a = _addressing()
    by_cidr = EgressPolicy.build(allow_out=["1.1.1.1"], deny_out=["0.0.0.0/0"])
    assert by_cidr.dns_opened == ()
    assert "dport 53 accept" not in rulesets.policy_update(a, by_cidr)
    named = EgressPolicy.build(allow_out=["example.com"], deny_out=["0.0.0.0/0"],
                               dns_servers=["1.1.1.1", "9.9.9.9"])
    rules = [r for r in rulesets.policy_update(a, named).splitlines()
             if " egress_user " in r]
    # Before the deny: E2B opens them whatever the lists say.
    assert rules[0] == ("add rule inet aenv egress_user ip daddr { 1.1.1.1/32, 9.9.9.9/32 } "
                        "meta l4proto { tcp, udp } th dport 53 accept")
    assert "0.0.0.0/0" in rules[1]
    none = EgressPolicy.build(allow_out=["example.com"], deny_out=["0.0.0.0/0"], dns_servers=[])
    assert "dport 53" not in rulesets.policy_update(a, none).replace("udp dport 53 redirect", "")


def test_a_proxied_slot_answers_dns_to_its_servers_only():
    a = _addressing()
    named = EgressPolicy.build(allow_out=["example.com"], dns_servers=["10.0.0.53"])
    redirect = [r for r in rulesets.policy_update(a, named).splitlines()
                if "udp dport 53" in r]
    assert len(redirect) == 1 and "ip daddr { 10.0.0.53/32 } udp dport 53 redirect" in \
        redirect[0]
    silent = EgressPolicy.build(allow_out=["example.com"], dns_servers=[])
    assert "udp dport 53" not in rulesets.policy_update(a, silent)


def test_an_upstream_proxy_redirects_all_the_guests_tcp_but_the_slots_own():
    from aenv.egress.socks import SocksProxy

    a = _addressing()
    p = EgressPolicy.build(deny_out=["0.0.0.0/0"], upstream=SocksProxy("10.9.9.9", 1080))
    assert p.needs_proxy
    tcp = [r for r in rulesets.policy_update(a, p).splitlines() if "redirect to :15080" in r]
    assert tcp == ['add rule inet aenv egress_redirect iifname "tap0" ip saddr 169.254.0.21 '
                   "ip daddr != 169.254.0.22 meta l4proto tcp redirect to :15080"]


def test_tcp_to_port_53_of_the_dns_servers_is_allowed_as_the_slot_table_does():
    p = EgressPolicy.build(allow_out=["example.com"], deny_out=["0.0.0.0/0"],
                           dns_servers=["1.1.1.1", "169.254.169.254"])
    assert p.tcp_allowed("1.1.1.1", 53) and not p.tcp_allowed("1.1.1.1", 443)
    assert not p.tcp_allowed("169.254.169.254", 53)  # metadata: never
    no_domain = EgressPolicy.build(allow_out=["9.9.9.9"], deny_out=["0.0.0.0/0"],
                                   dns_servers=["1.1.1.1"])
    assert not no_domain.tcp_allowed("1.1.1.1", 53)
