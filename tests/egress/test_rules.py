"""Domain entries, wildcards and header rules of ``EgressPolicy`` (what the proxy asks)."""

from __future__ import annotations

import pytest

from aenv.network.policy import (
    EgressPolicy,
    PolicyError,
    domain_pattern,
    header_rules,
    match_pattern,
)


@pytest.mark.parametrize("raw, pattern", [
    ("Example.COM", "example.com"), ("*.Example.com", "*.example.com"), ("a.b.", "a.b"),
    ("localhost", "localhost"), ("1.2.3.4", None), ("10.0.0.0/8", None), ("*", None),
    ("*.*.a.com", None), ("a..b", None), ("-a.com", None), ("a b.com", None), ("1.2.3", None),
])
def test_which_entries_are_names(raw: str, pattern: str | None) -> None:
    assert domain_pattern(raw) == pattern


def test_exact_beats_wildcard_and_the_longest_wildcard_wins() -> None:
    patterns = ["*.example.com", "*.api.example.com", "api.example.com"]
    assert match_pattern(patterns, "api.example.com") == "api.example.com"
    assert match_pattern(patterns, "v1.api.example.com") == "*.api.example.com"
    assert match_pattern(patterns, "x.y.example.com") == "*.example.com"
    assert match_pattern(patterns, "example.com") is None  # not the apex
    assert match_pattern(patterns, "badexample.com") is None
    assert match_pattern(patterns, "API.Example.com.") == "api.example.com"


def test_entries_split_into_cidrs_and_names() -> None:
    p = EgressPolicy.build(allow_out=["1.1.1.1", "PyPI.org", "*.github.com"],
                           deny_out=["0.0.0.0/0", "evil.com"])
    assert p.allow_out == ("1.1.1.1/32",) and p.deny_out == ("0.0.0.0/0",)
    assert p.allow_domains == ("pypi.org", "*.github.com") and p.deny_domains == ("evil.com",)
    assert p.needs_proxy and p.deny_by_default
    assert not EgressPolicy.build(allow_out=["1.1.1.1"]).needs_proxy


def test_an_allowed_name_wins_and_unnamed_ones_follow_the_cidr_default() -> None:
    closed = EgressPolicy.build(allow_out=["*.ok.com", "1.1.1.1"], deny_out=["0.0.0.0/0"])
    assert closed.decide_name("a.ok.com").allowed and closed.decide_name("a.ok.com").explicit
    assert not closed.decide_name("ok.com").allowed
    assert not closed.decide_name("other.com").allowed
    assert closed.decide_name("1.1.1.1").allowed and not closed.decide_name("1.1.1.2").allowed
    both = EgressPolicy.build(allow_out=["x.com"], deny_out=["x.com"])
    assert both.decide_name("x.com").allowed  # allowed entries always win
    opened = EgressPolicy.build(deny_out=["*.bad.com"])
    assert not opened.decide_name("a.bad.com").allowed
    verdict = opened.decide_name("good.com")
    assert verdict.allowed and not verdict.explicit  # its addresses are still judged
    assert not opened.ip_allowed("10.1.2.3") and opened.ip_allowed("93.184.216.34")
    assert not EgressPolicy.build(allow_internet=False).decide_name("good.com").allowed
    listed = EgressPolicy.build(allow_out=["10.1.0.0/16", "169.254.0.0/16"])
    assert listed.ip_listed("10.1.2.3") and not listed.ip_listed("10.2.0.1")
    assert not listed.ip_listed("169.254.169.254")  # metadata: never


def test_header_rules_pick_one_rule_set_and_merge_within_it() -> None:
    rules = header_rules({
        "*.Example.com": [{"transform": {"headers": {"X-A": "1"}}}, {}],
        "api.example.com": [{"transform": {"headers": {"X-B": "${e2b.secrets.k}"}}},
                            {"transform": {"headers": {"x-b": "2", "X-C": "3"}}}],
    })
    p = EgressPolicy.build(rules=rules)
    assert p.headers_for("api.example.com") == (("x-b", "2"), ("X-C", "3"))
    assert p.headers_for("v.example.com") == (("X-A", "1"),)
    assert p.headers_for("example.com") == ()


@pytest.mark.parametrize("rules, words", [
    ({"*": [{}]}, "rule keys"),
    ({"a.com": {}}, "list"),
    ({"a.com": [{"transform": "x"}]}, "transform"),
    ({"a.com": [{"transform": {"headers": {"Bad Name": "v"}}}]}, "not a valid header"),
    ({"a.com": [{"transform": {"headers": {"X": "a\r\nY: b"}}}]}, "not a valid header"),
    ({"a.com": [{"transform": {"headers": {"X": "${e2b.identity.tokens.aws}"}}}]},
     "only ${e2b.secrets"),
])
def test_bad_rules_are_refused(rules: dict, words: str) -> None:
    with pytest.raises(PolicyError, match=words.replace("$", r"\$").replace("{", r"\{")):
        header_rules(rules)


def test_a_sandboxs_proxy_may_not_be_private_unless_the_node_lists_the_range():
    from aenv.egress.setup import proxy_address_refused

    node = {"10.11.0.7"}  # what the node refuses anyway (its own, aenv's ranges)
    default = proxy_address_refused(lambda ip: ip in node, None)
    assert not default("203.0.113.9")
    for ip in ("10.1.2.3", "192.168.1.1", "127.0.0.1", "169.254.169.254", "100.64.0.1"):
        assert default(ip), ip
    listed = proxy_address_refused(lambda ip: ip in node, "10.0.0.0/8, 192.168.7.0/24")
    assert not listed("10.1.2.3") and not listed("192.168.7.5")
    assert listed("192.168.1.1") and listed("10.11.0.7")
