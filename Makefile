# `make demo` and `make test` set everything up on first use and reuse the venv after.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test clean

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/phalanx demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
