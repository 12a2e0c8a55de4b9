# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PY := .venv/bin/python

.PHONY: venv venv-test venv-vllm demo test test-fast test-slow test-distributed test-gpu test-vllm

# The demo installs only what it runs; the test extra (pytest, TRL, diffusers) is the tests' own.
venv:
	bash scripts/setup_venv.sh

venv-test:
	bash scripts/setup_venv.sh test

demo: venv
	$(PY) -m stacx demo

# Two pytest workers, one test file each at a time (module fixtures such as a tiny checkpoint or a
# two-node Ray cluster stay with their file); one core each on a 2-core machine. Files go out in the
# order tests/conftest.py gives them (the longest files first, the many short ones last), not xdist's own.
PARALLEL := -n 2 --dist loadfile --no-loadscope-reorder

# The whole suite; the 20 slowest tests are listed at the end of every run (CI prints them too).
test: venv-test
	$(PY) -m pytest -q $(PARALLEL) --durations=20

test-fast: venv-test
	$(PY) -m pytest -q $(PARALLEL) -m "not slow"

test-slow: venv-test
	$(PY) -m pytest -q $(PARALLEL) -m slow

test-distributed: venv-test
	$(PY) -m pytest -q -m distributed

test-gpu: venv-test
	$(PY) -m pytest -q -m gpu

# The vLLM tier: real vLLM servers (CPU build) from their own environment, .venv-vllm (docs/vllm.md); CI runs it after `make test` (.ci/run).
venv-vllm:
	bash scripts/setup_vllm_venv.sh .venv-vllm

test-vllm: venv-test venv-vllm
	STACX_VLLM_PYTHON=$(CURDIR)/.venv-vllm/bin/python $(PY) -m pytest -q -m vllm tests/vllm --durations=10 -o timeout=3600
