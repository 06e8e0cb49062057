# The README's two commands. Both create or reuse ./.venv (scripts/bootstrap.sh).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test

setup:
	bash scripts/bootstrap.sh

# A real training run: the bundled GPT on a public-domain English text, ZeRO on 2 local processes.
demo: setup
	$(VENV)/bin/zerodp train

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q
