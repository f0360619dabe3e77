# The README's two commands: `make run` and `make test`. Both set up what is missing first.
.PHONY: setup run test test-fast proto lint clean e2b-suite cluster cluster-stop

VENV := .venv

setup:
	@./scripts/setup.sh

run: setup
	@./scripts/run.sh

test: setup
	@$(VENV)/bin/pytest

# A cluster on this host (issue 18): Redis, two nodes and a gateway, driven by the E2B SDK
# (scripts/cluster.sh; docs/install.md "Many nodes"). cluster-stop stops all of it.
cluster: setup
	@./scripts/cluster.sh

cluster-stop:
	@./scripts/cluster-stop.sh

# The quick loop: every test that needs no VM, no network namespaces and no node, and is
# not marked slow (markers: pyproject.toml), on 4 pytest-xdist workers: these tests mostly
# wait on subprocesses and sockets, so 4 fit on 2 cores. One file's tests stay on one worker
# (--dist loadfile): a file's tests may share a fixed name prefix or port. make test still
# runs everything, serially.
# PYTHONDONTWRITEBYTECODE unset: pytest keeps its assertion-rewritten test modules in
# __pycache__, which halves collection in each of the four workers on every later run.
test-fast: setup
	@env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -n 4 --dist loadfile \
		-m "not vm and not net and not js and not slow"

# E2B's own SDK test suites, from a checkout of e2b-dev/E2B, against a fresh aenv server
# (docs/e2b-suite.md). E2B_SUITE_ARGS e.g. "--python-only -k create" for a quick check.
e2b-suite: setup
	@test -n "$(E2B_SRC)" || { echo "usage: make e2b-suite E2B_SRC=DIR [E2B_SUITE_ARGS=...]" >&2; exit 2; }
	@$(VENV)/bin/python scripts/e2b_suite.py --e2b-src "$(E2B_SRC)" $(E2B_SUITE_ARGS)

# Regenerate envd's protobuf messages (needs protobuf-compiler, libprotobuf-dev, protoc-gen-py).
proto:
	cd aenv/envd/proto && PATH=$(CURDIR)/$(VENV)/bin:$$PATH protoc -I. -I/usr/include --py_out=. process.proto filesystem.proto

# ruff, then mypy --strict on aenv/ (configured in pyproject.toml's [tool.mypy]).
# tests/test_lint.py runs the same two, so make test fails on what this reports.
lint:
	$(VENV)/bin/ruff check aenv tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .venv-e2b-2.7 tests/js/node_modules .pytest_cache
