# The two commands of the README: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint clean test-newest

# The newest other Python installed (3.13, then 3.12), for `test-newest`; empty when neither runs.
NEWEST := $(shell bash scripts/newest-python.sh)
NEWEST_VENV := .venv-newest

$(BIN)/stepwarden: pyproject.toml
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "stepwarden needs Python 3.11 or newer (set PY=python3.11)")'
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(BIN)/stepwarden

venv: $(BIN)/stepwarden

demo: venv
	$(BIN)/stepwarden demo

# mypy: src (the configuration's `files`), then tests/ and bench/ a group of folders per run, as
# pyproject.toml explains: each tests/ folder has its own top-level `conftest`, and
# bench/peers/common.py is `common` to the peer drivers but `peers.common` to bench/run.py.
lint: venv
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/mypy
	$(BIN)/mypy tests/conftest.py tests/acceptance tests/dashboard tests/apps
	$(BIN)/mypy tests/unit
	$(BIN)/mypy tests/integration
	$(BIN)/mypy tests/contract
	$(BIN)/mypy tests/chaos
	$(BIN)/mypy bench/peers
	$(BIN)/mypy bench/*.py
	$(BIN)/mypy scripts

# compileall: the tests start the CLI and workers as subprocesses (hundreds of them); where
# PYTHONDONTWRITEBYTECODE is set (as on this project's machines) each would otherwise compile stepwarden's
# sources again, ~0.2 s of every start on a 2-core machine.
# --dist worksteal: an idle pytest worker takes tests queued for the other. With the default
# (load), a worker was sent a long run of slow integration tests near the end and ran them alone
# for 200 s while the other sat idle (842 s against 591 s for the whole suite on 2 cores).
test: venv lint
	$(BIN)/python -m compileall -q src tests
	$(BIN)/python -m pytest -n 2 --dist worksteal -q --durations=15
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python ../shared/contract/check.py
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python scripts/contract_on_postgres.py ../shared/contract/check.py
	$(MAKE) --no-print-directory test-newest

# The unit tests (SQLite; the PostgreSQL cases deselected) on the newest other Python installed, in
# a venv of its own: Python 3.12's sqlite3 refused an executemany that 3.11's accepted, and a run
# on 3.11 alone could not see it. Nothing to do when no newer Python is installed.
$(NEWEST_VENV)/bin/stepwarden: pyproject.toml
	$(NEWEST) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/pip install -q --upgrade pip
	$(NEWEST_VENV)/bin/pip install -q -e '.[dev]'
	touch $(NEWEST_VENV)/bin/stepwarden

ifeq ($(NEWEST),)
test-newest:
	@echo "test-newest: no python3.13 or python3.12 installed; the unit tests ran on $$($(BIN)/python -V) only"
else
test-newest: $(NEWEST_VENV)/bin/stepwarden
	$(NEWEST_VENV)/bin/python -m pytest -n 2 --dist worksteal -q -p no:cacheprovider tests/unit -k "not postgres"
endif

clean:
	rm -rf $(VENV) $(NEWEST_VENV) .pytest_cache .mypy_cache .ruff_cache
