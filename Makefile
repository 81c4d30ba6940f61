# jflash: `make test` and `make demo` work from a fresh clone (README "Quick start").
# `make test` is CI's full run (`.ci/run`); `make test-fast` is the edit loop: no HF
# side environment, no `slow` tests (docs/testing.md).
SHELL := /bin/bash
VENV ?= .venv
ORACLE ?= .venv-oracle
# Python 3.12 for the project; where pyenv provides it, pick its 3.12.1.
PY312 ?= PYENV_VERSION=$${PYENV_VERSION:-3.12.1} python3.12
# Python 3.11 + CPU torch for the HuggingFace parity oracle (tests only, never imported).
PY311 ?= PYENV_VERSION=$${PYENV_VERSION:-3.11.7} python3.11
PYTEST_ARGS ?=

.PHONY: test test-fast demo demo-text venv oracle lint clean

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PY312) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e ".[dev]"
	touch $@

oracle: $(ORACLE)/.installed
$(ORACLE)/.installed: Makefile
	$(PY311) -m venv $(ORACLE)
	$(ORACLE)/bin/python -m pip install -q torch==2.13.0 "transformers>=5.21" safetensors numpy "jinja2>=3.1.6"
	touch $@

# The two environments are built side by side (on a clean machine their downloads are
# most of the setup), then the suite runs with both.
test:
	$(MAKE) --no-print-directory -j 2 venv oracle
	JFLASH_ORACLE_PYTHON=$(abspath $(ORACLE))/bin/python $(VENV)/bin/python -m pytest -n 2 $(PYTEST_ARGS)

# The quick subset: `-m "not slow"` (each oracle grid's covering cases, no 10 s+ tests),
# without the HF parity tests (they need the .venv-oracle side environment, which
# `make test` builds and runs them with), on two worker processes (pytest-xdist).
test-fast: venv
	$(VENV)/bin/python -m pytest -n 2 -m "not slow" --ignore=tests/test_models_parity.py $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/python -m train.demo

# A tiny Llama on real English text (the installed packages' docs), BPE, token caches;
# offline, a few minutes on a CPU (docs/trainer.md, "Real text").
demo-text: venv
	$(VENV)/bin/python -m train.text_demo

lint: venv
	$(VENV)/bin/ruff check jflash models train tests benchmarks
	$(VENV)/bin/ruff format --check jflash models train tests benchmarks

clean:
	rm -rf $(VENV) $(ORACLE) runs .pytest_cache
