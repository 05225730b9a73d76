# The two commands of the README: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint clean

$(BIN)/stepwarden: pyproject.toml
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "stepwarden needs Python 3.11 or newer (set PY=python3.11)")'
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(BIN)/stepwarden

venv: $(BIN)/stepwarden

demo: venv
	$(BIN)/stepwarden demo

lint: venv
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/mypy

test: venv lint
	$(BIN)/python -m pytest -n 2 -q
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python ../shared/contract/check.py
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python scripts/contract_on_postgres.py ../shared/contract/check.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
