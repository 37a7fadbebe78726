"""TRL's GRPOTrainer on the prompts of our uniform iterations: seconds per optimizer step.

Runs inside the scratch venv that benchmarks/train_throughput.py creates (TRL is not a dependency of
trace_lightning, and this file imports nothing from it). Input: a JSON file with the model folder,
the chat messages of each step's prompts and the token ids our trainer built from them; output: a
JSON file with per-step seconds and whether TRL's chat template gives the very same prompt ids.

    python benchmarks/trl_grpo_step.py spec.json out.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


class StepClock(TrainerCallback):
    """Wall seconds of each optimizer step: generation, scoring, backward and the update."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.seconds.append(time.perf_counter() - self._start)


def constant_reward(completions, **kwargs):  # type: ignore[no-untyped-def]
    """The reward's cost is not what is compared; a length-based one keeps the advantages non-zero."""
    return [float(len(str(c))) / 100.0 for c in completions]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    same_ids = [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
        == ids
        for m, ids in zip(spec["messages"], spec["prompt_ids"], strict=True)
    ]
    g, per_step = spec["group_size"], spec["prompts_per_step"]
    config = GRPOConfig(
        output_dir=spec["output_dir"],
        use_cpu=True,
        bf16=False,
        learning_rate=1e-5,
        per_device_train_batch_size=g * per_step,  # completions per step: one optimizer step per iteration
        gradient_accumulation_steps=1,
        num_generations=g,
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        beta=0.0,  # no reference model, as our kl_coef=0
        num_iterations=1,
        max_steps=len(spec["messages"]) // per_step,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
    )
    data = Dataset.from_list([{"prompt": m} for m in spec["messages"]])
    clock = StepClock()
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=constant_reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    out = {
        "step_seconds": clock.seconds,
        "prompt_ids_identical": same_ids,
        "trl": __import__("trl").__version__,
    }
    Path(sys.argv[2]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
