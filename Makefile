# Everything installs from nothing into .venv with pinned versions (constraints.txt).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt pip
	$(PY) -m pip install -q -c constraints.txt -e '.[all,dev]'
	touch $(STAMP)

demo: install
	$(PY) -m packrat_mq.cli.demo

test: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

test-fast: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) build *.egg-info
