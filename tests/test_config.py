"""The one settings module: every field names its variable, parses its type, refuses bad
values naming the variable, and never prints the API key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from aenv import config, runtime
from aenv.config import ClientSettings, Settings, SettingsError

KEY = "e2b_" + "a" * 40


def test_every_field_declares_a_variable_and_a_description() -> None:
    for cls in (Settings, ClientSettings):
        for f in dataclasses.fields(cls):
            var = f.metadata.get("var")
            assert var is not None, f"{cls.__name__}.{f.name} has no setting(...)"
            assert all(re.fullmatch(r"(AENV|E2B)_[A-Z0-9_]+", n) for n in var.names)
            assert var.doc and "\n" not in var.doc and "|" not in var.doc


def test_server_variables_are_unique() -> None:
    names = [n for _, var in Settings.variables() for n in var.names]
    assert len(names) == len(set(names))


def test_an_empty_environment_gives_the_declared_defaults() -> None:
    assert Settings.from_env({}) == Settings()
    assert ClientSettings.from_env({}) == ClientSettings()


def test_values_are_parsed_by_the_annotated_type() -> None:
    s = Settings.from_env({
        "AENV_LISTEN_PORT": " 4000 ", "AENV_RETENTION_HOURS": "1.5",
        "AENV_CPU_OVERCOMMIT": "4", "AENV_SNAPSHOT_BASE": "off", "AENV_TLS_SELF_SIGNED": "Yes",
        "AENV_HOME": "/srv/aenv", "AENV_TLS_CERT": "/etc/aenv/cert.pem",
        "AENV_LOG_LEVEL": "DEBUG", "AENV_API_KEY": f" {KEY}\n"})
    assert (s.listen_port, s.retention_hours, s.cpu_overcommit) == (4000, 1.5, 4.0)
    assert (s.snapshot_base, s.tls_self_signed) == (False, True)
    assert s.home == Path("/srv/aenv") and s.tls_cert == Path("/etc/aenv/cert.pem")
    assert s.log_level == "debug" and s.api_key == KEY


def test_an_empty_value_counts_as_unset() -> None:
    """docker-compose's ``${AENV_API_KEY:-}`` passes an empty variable."""
    s = Settings.from_env({"AENV_API_KEY": "", "AENV_LISTEN_PORT": "  ", "AENV_HOME": ""})
    assert s.api_key is None and s.listen_port == 3000 and s.home == Settings().home


@pytest.mark.parametrize(("env", "message"), [
    ({"AENV_LISTEN_PORT": "http"}, "AENV_LISTEN_PORT='http' is not a whole number"),
    ({"AENV_LISTEN_PORT": "65536"}, "AENV_LISTEN_PORT='65536' is not a TCP port"),
    ({"AENV_MAX_SANDBOXES": "-1"}, "AENV_MAX_SANDBOXES='-1' must be at least 0"),
    ({"AENV_CPU_OVERCOMMIT": "0"}, "AENV_CPU_OVERCOMMIT='0' must be more than 0"),
    ({"AENV_MEMORY_OVERCOMMIT": "nan"}, "AENV_MEMORY_OVERCOMMIT='nan' is not a finite"),
    ({"AENV_SNAPSHOT_BASE": "sometimes"}, "AENV_SNAPSHOT_BASE='sometimes' is not a boolean"),
    ({"AENV_LOG_LEVEL": "loud"}, "AENV_LOG_LEVEL='loud' is not one of critical, error"),
    ({"AENV_HOST_CIDR": "10.11.0.1/16"}, "AENV_HOST_CIDR='10.11.0.1/16' is not an IPv4"),
    ({"AENV_NAME_PREFIX": "My-Aenv"}, "AENV_NAME_PREFIX='My-Aenv' must be lower-case"),
    ({"AENV_RUNTIME": "kvm"}, "AENV_RUNTIME='kvm' is not one of qemu, firecracker"),
])
def test_a_bad_value_is_refused_naming_the_variable(env: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        Settings.from_env(env)


def test_a_directory_is_not_a_certificate(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"AENV_TLS_KEY=.* is a directory"):
        Settings.from_env({"AENV_TLS_KEY": str(tmp_path)})


def test_the_api_key_is_hidden_when_printed() -> None:
    for s in (Settings(api_key=KEY), ClientSettings(api_key=KEY),
              Settings.from_env({"AENV_API_KEY": KEY})):
        assert KEY not in repr(s) and KEY not in str(s) and KEY not in f"{s}"
        assert "api_key=<hidden>" in repr(s)
    assert "api_key=None" in repr(Settings())


def test_the_client_falls_back_to_the_e2b_variables_in_order() -> None:
    c = ClientSettings.from_env({"E2B_API_URL": "http://a:1", "E2B_API_KEY": "k2"})
    assert (c.url, c.api_key) == ("http://a:1", "k2")
    c = ClientSettings.from_env({"AENV_URL": "http://b:2", "E2B_API_URL": "http://a:1",
                                 "AENV_API_KEY": "k1", "E2B_API_KEY": "k2"})
    assert (c.url, c.api_key) == ("http://b:2", "k1")
    c = ClientSettings.from_env({"AENV_API_KEY": "", "E2B_API_KEY": "k2"})
    assert c.api_key == "k2"


@pytest.mark.parametrize(("raw", "verify"), [("0", False), ("false", False), ("NO", False),
                                             ("1", True), ("off", True), ("", True)])
def test_tls_verify_is_off_only_for_0_false_no(raw: str, verify: bool) -> None:
    assert ClientSettings.from_env({"AENV_TLS_VERIFY": raw}).tls_verify is verify


def test_flags_override_the_environment_and_are_checked() -> None:
    s = Settings.from_env({"AENV_LISTEN_PORT": "4000", "AENV_DOMAIN": "env.example"})
    o = s.override({"listen_port": 5000, "domain": None})
    assert (o.listen_port, o.domain) == (5000, "env.example")
    with pytest.raises(SettingsError, match=re.escape("--port 70000 is not a TCP port")):
        s.override({"listen_port": 70000}, {"listen_port": "--port"})


def test_the_runtime_choices_are_the_runtime_packages() -> None:
    assert config.RUNTIMES == runtime.RUNTIMES
