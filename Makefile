# Set-up is part of every target: a fresh machine needs only `make bench` or `make test`.
VENV  ?= .venv
PY    := $(VENV)/bin/python
# torch first and pinned: this version's CPU build lies on local disk here; a looser requirement
# would pull a multi-GB CUDA build. GPU users: make setup TORCH=torch (see README).
TORCH ?= torch==2.13.0
NPROC := $(shell nproc 2>/dev/null || echo 2)

.PHONY: setup bench test test-all
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# the main job: a default sweep on a synthesized model (no download), both engines, three depths
bench: setup
	$(VENV)/bin/moebench sweep -m preset:small -e llama-cpp,reference --n-cpu-moe 0,4,all \
		-w pp512,tg128 -r 3 --threads $(NPROC)

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m ''
