#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU and the `vllm` extra installed (the Docker image, or
# `pip install -e '.[dev,vllm]'` plus the data packages of the Makefile):
#
#   bash benchmarks/gpu_check.sh          # ~10 min on one GPU (+5 with two); JSON in benchmarks/results/gpu_*.json
#
# 1. the vLLM engine tests (round trip, full and LoRA sync, prefix-cache reset, branching, a TRACE
#    iteration through Lightning) against vLLM on the GPU;
# 2. vLLM against the transformers engine on SmolLM2-135M + LoRA: same prompts, same sampling,
#    tokens per second and their ratio, prefix reuse, and weight-sync time as a share of an iteration;
# 3. one FSDP iteration of the default job with the vLLM engine;
# 4. FSDP2 (trainer=fsdp2, the config CI runs on 2 CPU processes) on every GPU with vLLM sleeping
#    during training: the tiny debug job (full weights), then one iteration of SmolLM2 + LoRA. Each
#    prints its run summary (sampling, weight-sync and training seconds) and the engine figures.
# 5. With two or more GPUs: 2 processes, FSDP2 and one colocated vLLM engine per process,
#    recorded per process and iteration by benchmarks/colocated_run.py into
#    benchmarks/results/gpu_colocated_*.json: the tiny debug job, where one process gets no prompt at
#    all (the configuration that once hung), then 2 iterations of SmolLM2 + LoRA, then the
#    same with one engine sliced over both GPUs (engine.tensor_parallel_size=2). Each run has a
#    torch.distributed timeout and a wall-clock `timeout`, so a hang fails instead of waiting; the exit
#    codes go into benchmarks/results/gpu_colocated_status.txt.
#
#   GPU_CHECK_ONLY=fsdp2 bash benchmarks/gpu_check.sh   # step 4 alone (~3 min): for a short lent GPU
#   GPU_CHECK_ONLY=multi bash benchmarks/gpu_check.sh   # step 5 alone (~5 min on 2 GPUs)
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
    echo "== 4/5 FSDP2 on $ngpu GPU(s), vLLM with sleep/wake"
    "$PY" -m trace_lightning.trainer trainer=fsdp2 trainer.accelerator=gpu trainer.devices="$ngpu" \
        debug=fast engine=vllm engine.sleep_mode=true logger=none task_name=gpu_check_fsdp2_tiny
    "$PY" -m trace_lightning.trainer trainer=fsdp2 trainer.accelerator=gpu trainer.devices="$ngpu" \
        engine=vllm engine.sleep_mode=true trainer.max_epochs=1 logger=none task_name=gpu_check_fsdp2_lora
    # the per-iteration figures the run logged (engine sync and sampling seconds, engine/trainer gap)
    grep -h "iteration" outputs/gpu_check_fsdp2_*/*/trainer.log | tail -n 8 || true
}
multi_gpu_check() {
    local ngpu status=benchmarks/results/gpu_colocated_status.txt
    ngpu=$(nvidia-smi -L | wc -l)
    if [ "$ngpu" -lt 2 ]; then
        echo "== 5/5 skipped: 2-process FSDP2 + vLLM needs two GPUs, this machine has $ngpu"
        return 0
    fi
    echo "== 5/5 2 processes on 2 of $ngpu GPUs: FSDP2, one colocated vLLM engine per process"
    : > "$status"
    local gpus=(trainer=fsdp2 trainer.accelerator=gpu trainer.devices=2 engine=vllm engine.sleep_mode=true)
    run_colocated idle_tiny "${gpus[@]}" debug=fast
    run_colocated smollm2_lora "${gpus[@]}" trainer.max_epochs=2
    run_colocated smollm2_lora_tp2 "${gpus[@]}" trainer.max_epochs=2 engine.tensor_parallel_size=2
    cat "$status"
}
run_colocated() {  # NAME OVERRIDES...: one recorded run; its exit code (124: the wall clock ran out)
    local name=$1 rc=0
    shift
    timeout -k 30 1200 "$PY" benchmarks/colocated_run.py --timeout 600 \
        --out "benchmarks/results/gpu_colocated_$name.json" "$@" task_name="gpu_colocated_$name" || rc=$?
    echo "$name exit=$rc" >> benchmarks/results/gpu_colocated_status.txt
}
case "${GPU_CHECK_ONLY:-}" in
    fsdp2) fsdp2_check; exit 0 ;;
    multi) multi_gpu_check; exit 0 ;;
esac

echo "== 1/5 vLLM engine tests on the GPU"
"$PY" -m pytest -m vllm -q tests/engines/test_engine_vllm.py

echo "== 2/5 vLLM vs transformers engine, weight sync"
"$PY" benchmarks/engine_throughput.py --device cuda --out benchmarks/results/gpu_engine_throughput.json

echo "== 3/5 one FSDP iteration with the vLLM engine, then the default job in bfloat16 (model.dtype=auto)"
"$PY" -m trace_lightning.trainer trainer=gpu trainer.strategy=fsdp trainer.devices=1 trainer.max_epochs=1 \
    engine=vllm logger=none task_name=gpu_check
# bf16 weights and bf16-mixed autocast (trainer=gpu's), LoRA in float32: trains, checkpoints, resumes;
# the engine/trainer log-prob gap it logs is the bf16 rounding gap
"$PY" -m trace_lightning.trainer trainer=gpu trainer.max_epochs=2 engine=vllm model.dtype=bfloat16 \
    run_dir=outputs/gpu_check_bf16/run task_name=gpu_check_bf16
"$PY" -m trace_lightning.trainer trainer=gpu trainer.max_epochs=3 engine=vllm model.dtype=bfloat16 \
    run_dir=outputs/gpu_check_bf16/run task_name=gpu_check_bf16 ckpt_path=last
grep -h "logprob" outputs/gpu_check_bf16/run/trainer.log | tail -n 3 || true
fsdp2_check
multi_gpu_check
echo "gpu_check: all five steps finished"
