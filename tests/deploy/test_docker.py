"""deploy/docker/Dockerfile and deploy/docker-compose.yml, checked without a Docker engine
(none runs on the development machine, so `docker build` is not tested here): the build
inputs exist and pass the ignore file, the packages come from the one list, the
entrypoint is a real command of this project, and the compose service is wired as the
docs say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
import yaml

from aenv.cli.main import app
from tests.conftest import ROOT
from tests.deploy.files import (
    COMPOSE,
    DOCKERFILE,
    DOCKERIGNORE,
    INSTALL_DOC,
    Instruction,
    copy_sources,
    dockerignore_admits,
    exec_form,
    image_ref,
    parse_dockerfile,
    pyproject,
)


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def only(instructions: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in instructions if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {len(found)}"
    return found[0]


def files_below(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


# -- Dockerfile -------------------------------------------------------------------------

def test_image_is_built_on_debian_bookworm_slim(instructions):
    assert instructions[0] == Instruction("FROM", "debian:bookworm-slim")


def test_every_copy_source_exists_in_the_repository(instructions):
    copies = [i for i in instructions if i.keyword == "COPY"]
    assert copies
    for ins in copies:
        assert "--from" not in ins.args
        for src in copy_sources(ins):
            assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"


def test_ignore_file_lets_every_copied_file_into_the_context(instructions):
    ignore = DOCKERIGNORE.read_text()
    for ins in (i for i in instructions if i.keyword == "COPY"):
        for src in copy_sources(ins):
            for f in files_below(ROOT / src):
                rel = f.relative_to(ROOT).as_posix()
                assert dockerignore_admits(ignore, rel), f"{rel} is excluded from the context"


def test_ignore_file_keeps_development_trees_out_of_the_context():
    ignore = DOCKERIGNORE.read_text()
    for rel in (".venv/bin/python", "tests/js/node_modules/e2b/package.json",
                "aenv/__pycache__/config.cpython-311.pyc", ".git/HEAD"):
        assert not dockerignore_admits(ignore, rel), rel


def test_no_add_instructions(instructions):
    assert "ADD" not in {i.keyword for i in instructions}


def test_packages_come_from_host_packages_sh_in_one_cached_layer(instructions):
    installs = [i for i in instructions if i.keyword == "RUN" and "apt-get install" in i.args]
    assert len(installs) == 1
    run = installs[0].args
    assert "$(/tmp/aenv/deploy/host-packages.sh)" in run
    assert "--no-install-recommends" in run
    assert "apt-get update" in run and "rm -rf /var/lib/apt/lists" in run


def test_host_packages_sh_finds_setup_sh_where_the_image_puts_it(instructions):
    dests = {copy_sources(i)[0]: i.args.split()[-1] for i in instructions if i.keyword == "COPY"}
    assert dests["scripts/setup.sh"] == "/tmp/aenv/scripts/setup.sh"
    assert dests["deploy/host-packages.sh"] == "/tmp/aenv/deploy/host-packages.sh"


def test_entrypoint_is_the_aenv_console_script_serving_on_all_addresses(instructions):
    argv = exec_form(only(instructions, "ENTRYPOINT"))
    assert argv[:2] == ["tini", "--"]
    program, sub, *options = argv[2:]
    assert program in pyproject()["project"]["scripts"]
    server = typer.main.get_command(app).commands[sub]
    known = {opt for p in server.params for opt in p.opts}
    assert options == ["--host", "0.0.0.0"]
    assert "--host" in known


def test_tools_the_image_runs_are_installed(instructions):
    run = next(i.args for i in instructions if i.keyword == "RUN" and "apt-get install" in i.args)
    assert re.search(r"\btini\b", run) and re.search(r"\bcurl\b", run)


def test_image_keeps_state_in_a_volume_and_serves_port_3000(instructions):
    assert only(instructions, "VOLUME").args == '["/var/lib/aenv"]'
    assert only(instructions, "EXPOSE").args == "3000"
    assert "AENV_HOME=/var/lib/aenv" in only(instructions, "ENV").args
    assert "/health" in only(instructions, "HEALTHCHECK").args


def test_docs_build_the_image_under_the_name_the_manifests_use():
    assert f"docker build -f deploy/docker/Dockerfile -t {image_ref()} ." in INSTALL_DOC.read_text()
    assert f"-t {image_ref()} ." in DOCKERFILE.read_text()


# -- docker-compose.yml -----------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def service(compose) -> dict:
    assert list(compose["services"]) == ["aenv"]
    return compose["services"]["aenv"]


def test_compose_builds_the_dockerfile_from_the_repository_root(service):
    build = service["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context == ROOT
    assert (context / build["dockerfile"]).resolve() == DOCKERFILE
    assert service["image"] == image_ref()


def test_compose_runs_privileged_with_kvm_and_tun(service):
    assert service["privileged"] is True
    assert {"/dev/kvm", "/dev/net/tun"} <= set(service["devices"])


def test_compose_keeps_state_in_a_declared_named_volume(compose, service):
    (mount,) = service["volumes"]
    name, target = mount.split(":")
    assert target == "/var/lib/aenv"
    assert name in compose["volumes"]


def test_compose_publishes_the_api_on_loopback_only(service):
    assert service["ports"] == ["127.0.0.1:3000:3000"]


def test_compose_healthcheck_asks_health_on_the_served_port(service):
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "curl" and "-f" in " ".join(test)
    assert test[-1] == "http://127.0.0.1:3000/health"
    assert service["healthcheck"]["start_period"]


def test_compose_gives_guest_ram_room_in_dev_shm(service):
    assert service["shm_size"]


def test_health_answers_without_an_api_key(server):
    """Docker, Compose and Kubernetes probe /health without a key."""
    import httpx

    r = httpx.get(server.url + "/health", timeout=10)
    assert 200 <= r.status_code < 300
