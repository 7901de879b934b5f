# Everything installs from nothing into .venv with pinned versions (constraints.txt).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test test-fast bench bench-peers bench-peers-lone clean

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

# TorchServe side by side (not part of make test). TorchServe gets its own venv, pinned in
# benchmarks/peers/constraints.txt with the project's torch. Options: make bench-peers ARGS="--quick --markdown"
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed-stamp

$(PEERS_STAMP): benchmarks/peers/constraints.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q -c benchmarks/peers/constraints.txt pip
	$(PEERS_VENV)/bin/python -m pip install -q -c benchmarks/peers/constraints.txt \
		torchserve torch-model-archiver pyyaml torch numpy
	touch $(PEERS_STAMP)

bench-peers: install $(PEERS_STAMP)
	$(PY) -m benchmarks.bench_peers $(ARGS)

# One request at a time, both servers up at once and requests alternating between them.
bench-peers-lone: install $(PEERS_STAMP)
	$(PY) -m benchmarks.bench_peers_lone $(ARGS)

clean:
	rm -rf $(VENV) $(PEERS_VENV) build *.egg-info
