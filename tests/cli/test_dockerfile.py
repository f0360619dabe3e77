"""Dockerfiles as template steps: what each instruction becomes, and what is refused."""

from __future__ import annotations

import pytest

from aenv.cli.dockerfile import DockerfileError, parse_dockerfile


def steps(text: str) -> list[tuple[str, list[str]]]:
    return [(s["type"], s["args"]) for s in parse_dockerfile(text).steps]


def test_from_names_the_parent_template() -> None:
    assert parse_dockerfile("FROM python-base AS build\n").from_template == "python-base"


def test_instructions_become_steps_in_order() -> None:
    assert steps("""
        FROM base
        ENV A=1 B="two words"
        RUN apt-get update && \\
            # a comment inside a continuation
            apt-get install -y curl
        WORKDIR /app
        USER user
        RUN ["echo", "hi there"]
    """) == [
        ("ENV", ["A", "1", "B", "two words"]),
        ("RUN", ["apt-get update && apt-get install -y curl"]),
        ("WORKDIR", ["/app"]),
        ("USER", ["user"]),
        ("RUN", ["echo 'hi there'"]),
    ]


def test_legacy_env_and_arg_become_env_steps() -> None:
    assert steps("ARG V=1\nFROM base\nENV GREETING hello world\nARG EMPTY\n") == [
        ("ENV", ["V", "1"]), ("ENV", ["GREETING", "hello world"]), ("ENV", ["EMPTY", ""])]


def test_copy_keeps_owner_and_mode_per_source() -> None:
    assert steps("FROM base\nCOPY --chown=user:user --chmod=755 a.sh b/ /opt/\n"
                 'ADD ["c d", "/e"]\n') == [
        ("COPY", ["a.sh", "/opt/", "user:user", "0755"]),
        ("COPY", ["b/", "/opt/", "user:user", "0755"]),
        ("COPY", ["c d", "/e", "", ""]),
    ]


@pytest.mark.parametrize(("text", "start"), [
    ('CMD ["python3", "-m", "http.server"]', "python3 -m http.server"),
    ("CMD python3 app.py", "python3 app.py"),
    ('ENTRYPOINT ["python3"]\nCMD ["app.py"]', "python3 app.py"),
    ('ENTRYPOINT ["tini", "--"]\nCMD run.sh', "tini -- /bin/sh -c run.sh"),
    ('ENTRYPOINT exec server\nCMD ["ignored"]', "exec server"),
])
def test_cmd_and_entrypoint_combine_as_in_docker(text: str, start: str) -> None:
    assert parse_dockerfile(f"FROM base\n{text}\n").start_cmd == start


def test_metadata_instructions_are_skipped() -> None:
    assert steps("FROM base\nEXPOSE 80\nLABEL a=b\nVOLUME /data\n") == []


@pytest.mark.parametrize(("text", "message"), [
    ("RUN true", "RUN before FROM"),
    ("FROM a\nFROM b", "multi-stage"),
    ("FROM a\nRUN --mount=type=cache,target=/c make", "RUN --mount"),
    ("FROM a\nCOPY --from=build /x /y", "--from"),
    ("FROM a\nADD https://example.com/x /x", "URL"),
    ("FROM a\nRUN <<EOF\necho\nEOF", "heredocs"),
    ("FROM a\nHEALTHCHECK CMD true", "HEALTHCHECK is not supported"),
    ("FROM a\nCOPY --chmod=abc x /y", "octal"),
    ("ENV A=1", "before FROM"),
    ("# nothing", "no FROM"),
])
def test_what_cannot_be_built_faithfully_is_refused(text: str, message: str) -> None:
    with pytest.raises(DockerfileError, match=message):
        parse_dockerfile(text)


def test_errors_name_the_line() -> None:
    with pytest.raises(DockerfileError, match="line 3"):
        parse_dockerfile("FROM base\n\nSHELL [\"/bin/zsh\"]\n")


@pytest.mark.parametrize(("parent", "key"), [
    ("base", "fromTemplate"), ("mine:v2", "fromTemplate"), ("node:20-slim", "fromImage"),
    ("127.0.0.1:5000/team/img:1", "fromImage"),
])
def test_from_is_a_template_of_the_server_or_else_an_image(parent: str, key: str) -> None:
    from aenv.cli.template import build_spec

    recipe = parse_dockerfile(f"FROM {parent}\nRUN true\n")
    spec = build_spec(recipe, {}, templates={"base", "tid0", "mine"})
    assert spec[key] == parent and ({"fromTemplate", "fromImage"} - {key}).isdisjoint(spec)
