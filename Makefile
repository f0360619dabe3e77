# The README's two commands: `make run` and `make test`. Both set up what is missing first.
.PHONY: setup run test proto lint clean

VENV := .venv

setup:
	@./scripts/setup.sh

run: setup
	@./scripts/run.sh

test: setup
	@$(VENV)/bin/pytest

# Regenerate envd's protobuf messages (needs protobuf-compiler, libprotobuf-dev, protoc-gen-py).
proto:
	cd aenv/envd/proto && PATH=$(CURDIR)/$(VENV)/bin:$$PATH protoc -I. -I/usr/include --py_out=. process.proto filesystem.proto

lint:
	$(VENV)/bin/ruff check aenv tests benchmarks

clean:
	rm -rf $(VENV) .venv-e2b-2.7 tests/js/node_modules .pytest_cache
