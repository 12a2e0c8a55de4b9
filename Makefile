# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PY := .venv/bin/python

.PHONY: venv demo test test-fast test-slow test-distributed test-gpu

venv:
	bash scripts/setup_venv.sh

demo: venv
	$(PY) -m stacx demo

test: venv
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m "not slow"

test-slow: venv
	$(PY) -m pytest -q -m slow

test-distributed: venv
	$(PY) -m pytest -q -m distributed

test-gpu: venv
	$(PY) -m pytest -q -m gpu
