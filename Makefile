# The README's two commands. Both create or reuse ./.venv (scripts/bootstrap.sh).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test

setup:
	bash scripts/bootstrap.sh

# A real training run: the bundled GPT on a public-domain English text, ZeRO on 2 local processes.
demo: setup
	$(VENV)/bin/zerodp train

# Two pytest workers (pytest-xdist), each with its own gloo worlds, a test file to a worker: most
# cases are ranks waiting on each other or on a subprocess's imports, so one worker left a core
# idle ~30% of the suite (142% CPU). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
