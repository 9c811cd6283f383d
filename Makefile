# Set-up is part of every target: a fresh machine needs only `make bench` or `make test`.
VENV  ?= .venv
PY    := $(VENV)/bin/python
# torch first and pinned: this version's CPU build lies on local disk here; a looser requirement
# would pull a multi-GB CUDA build. GPU users: make setup TORCH=torch (docs/getting-started.md).
TORCH ?= torch==2.13.0
NPROC := $(shell nproc 2>/dev/null || echo 2)

.PHONY: setup peers test-deps bench test test-all docs
setup: $(VENV)/.installed

# llama-cpp-python before the project: built for this CPU with a compiler that compiles its AMX code right,
# from moebench's own wheel cache, never pip's (scripts/install_llama_cpp.py says why)
$(VENV)/.installed: pyproject.toml scripts/install_llama_cpp.py engines/ggml_build.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) scripts/install_llama_cpp.py
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# the optional peer engines (ik-llama-cpp, reference@experts=kt), each in its own directory under the venv
peers: setup
	$(PY) scripts/install_peers.py

# the main job: a default sweep on a synthesized model (no download), both engines, three depths
bench: setup
	$(VENV)/bin/moebench sweep -m preset:small -e llama-cpp,reference --n-cpu-moe 0,4,all \
		-w pp512,tg128 -r 3 --threads $(NPROC)

# What the tests need beyond the venv: headless Chromium renders report.html in one test (Debian's package, as
# .ci/run installs it). Installed here when we are root with apt-get (a fresh CI machine runs every test);
# elsewhere, or when the install fails, that one test is skipped and pytest prints why (-rs). NO_APT=1: never.
test-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ -z "$(NO_APT)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium (Debian package) for the report rendering test"; \
	    ( export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq chromium >/dev/null ) \
	      || echo "warning: could not install chromium; the report rendering test will be skipped"; \
	  else \
	    echo "note: chromium is missing and only root with apt-get installs it; the report rendering test will be skipped"; \
	  fi; }

test: setup test-deps
	$(PY) -m pytest -q -rsx

test-all: setup test-deps
	$(PY) -m pytest -q -rsx -m ''

# the documentation site (docs/, mkdocs.yml) into site/; --strict: a broken link or a page left out of nav fails
docs: setup
	$(PY) -m pip install -q -e '.[docs]'
	$(VENV)/bin/mkdocs build --strict
