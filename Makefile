# `make demo` and `make test` set everything up on first use and reuse the venv after.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast lint clean

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/phalanx demo

# Every tier: unit, integration (processes on gloo), gpu (skipped without CUDA): two test processes
# at once, then the tests marked serial alone (scripts/test.sh). TEST_WORKERS=N changes the two;
# PYTEST_ARGS reach both parts.
test: $(VENV)/.installed
	PY=$(PY) bash scripts/test.sh $(PYTEST_ARGS)

# The unit tier only: one process each, no launch and no spawn; under a minute on 2 cores.
test-fast: $(VENV)/.installed
	PY=$(PY) bash scripts/test.sh tests/unit $(PYTEST_ARGS)

# ruff (configured in pyproject.toml): lint rules, then the formatter in check mode.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
