"""What ``aenv server`` runs with: a flag wins over its variable, which wins over the
declared default, and the limits and admission budget come from the settings (no root
needed: nothing is started)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aenv.cli import server as cli_server
from aenv.cli.main import app
from aenv.config import Settings, SettingsError
from aenv.orchestrator.admission import Budget
from aenv.orchestrator.service import Limits
from aenv.server import ServerOptions

NO_FLAGS = {f.name: None for f, var in Settings.variables() if var.flag}


def test_without_flags_or_variables_the_server_runs_with_the_declared_defaults() -> None:
    s = cli_server.server_settings(NO_FLAGS, {})
    assert s == Settings()
    assert (s.listen_host, s.listen_port, s.domain) == ("127.0.0.1", 3000, "localhost")


def test_a_flag_wins_over_its_variable_which_wins_over_the_default() -> None:
    env = {"AENV_LISTEN_PORT": "4000", "AENV_MAX_FORK": "4", "AENV_SNAPSHOT_BASE": "0"}
    s = cli_server.server_settings({**NO_FLAGS, "listen_port": 5000}, env)
    assert (s.listen_port, s.max_fork, s.snapshot_base) == (5000, 4, False)
    s = cli_server.server_settings({**NO_FLAGS, "snapshot_base": True}, env)
    assert (s.listen_port, s.snapshot_base) == (4000, True)


def test_a_bad_flag_is_refused_naming_the_flag() -> None:
    with pytest.raises(SettingsError, match=re.escape("--log-level 'loud' is not one of")):
        cli_server.server_settings({**NO_FLAGS, "log_level": "loud"}, {})


def test_every_flag_of_aenv_server_is_a_declared_setting() -> None:
    """The flags are the settings' ``flag=``s and nothing else (help and --port alike)."""
    command = next(c for c in app.registered_commands if c.callback is cli_server.server)
    params = inspect.signature(command.callback).parameters
    declared = {var.flag for _, var in Settings.variables() if var.flag}
    given = {p.default.param_decls[0] for p in params.values()}
    assert given == declared


def test_the_help_names_each_variable_and_default() -> None:
    out = CliRunner().invoke(app, ["server", "--help"], env={"COLUMNS": "200"}).output
    assert "env AENV_LISTEN_PORT, default 3000" in out
    assert "env AENV_SNAPSHOT_BASE, default 1" in out


def test_default_settings_give_the_orchestrators_own_defaults() -> None:
    options = ServerOptions.from_settings(Settings())
    assert options.limits == Limits() and options.budget == Budget()
    assert options.domain == ServerOptions().domain
    assert options.snapshot_base == ServerOptions().snapshot_base


def test_limits_budget_and_retention_come_from_the_environment() -> None:
    s = Settings.from_env({
        "AENV_MAX_SANDBOXES": "5", "AENV_MAX_STARTING": "2", "AENV_MAX_FORK": "3",
        "AENV_RETENTION_HOURS": "0.5", "AENV_CPU_OVERCOMMIT": "4",
        "AENV_MEMORY_OVERCOMMIT": "1.5", "AENV_DISK_RESERVE_MB": "100",
        "AENV_MAX_SANDBOX_CPU": "2", "AENV_MAX_SANDBOX_MEMORY_MB": "1024",
        "AENV_MAX_SANDBOX_DISK_MB": "4096", "AENV_DOMAIN": "sbx.example.com",
        "AENV_SNAPSHOT_BASE": "no"})
    o = ServerOptions.from_settings(s)
    assert o.limits == Limits(max_sandboxes=5, max_starting=2, max_fork=3, retention_s=1800)
    assert o.budget == Budget(cpu_overcommit=4, memory_overcommit=1.5, disk_reserve_mb=100,
                              max_cpu_per_sandbox=2, max_memory_mb_per_sandbox=1024,
                              max_disk_mb_per_sandbox=4096)
    assert (o.domain, o.snapshot_base) == ("sbx.example.com", False)


def test_the_orchestrator_admits_with_the_servers_budget(tmp_path: Path) -> None:
    from aenv.server import Server
    from tests.control.process_machines import ProcessMachines

    s = Settings(home=tmp_path, max_sandbox_cpu=2, cpu_overcommit=3.0, retention_hours=1.0)
    srv = Server(s, ProcessMachines(), ServerOptions.from_settings(s))
    try:
        assert srv.orchestrator.admission.budget.max_cpu_per_sandbox == 2
        assert srv.orchestrator.admission.budget.cpu_overcommit == 3.0
        assert srv.orchestrator.limits.retention_s == 3600
    finally:
        srv.db.close()
