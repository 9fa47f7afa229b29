# Every target creates .venv and installs the project on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check epp simulator tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy --strict epp simulator

test: $(STAMP) lint typecheck
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -p no:cacheprovider

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

bench: $(STAMP)
	$(BIN)/python benchmarks/request_path.py
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
