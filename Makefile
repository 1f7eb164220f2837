# clawrl developer entry points.
#   make test      create .venv if needed, install clawrl (CPU torch pinned), run the whole test suite
#   make install   only the install step
#   make lint      ruff check + format check
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.clawrl-installed

.PHONY: test install lint demo

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# On a machine without an NVIDIA driver pin the local CPU build of torch first, so that resolving
# `torch>=2.11` for clawrl installs nothing more (a plain `pip install torch` pulls a multi-GB CUDA build).
$(STAMP): $(PY) pyproject.toml
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q -n 2 --dist loadfile --durations=30 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check clawrl tests bench
	$(VENV)/bin/ruff format --check clawrl tests bench

demo: $(STAMP)
	$(VENV)/bin/clawrl demo
