"""`python -m trace_lightning.warmstart`: the supervised warm start, before any RL.

python -m trace_lightning.warmstart                        # SmolLM2 + LoRA on search_qa demonstrations
python -m trace_lightning.warmstart env=math_tool epochs=3
python -m trace_lightning.trainer model.warm_start=<the folder it prints>

A small instruct model asked to use tools answers closed-book in one turn, so RL never sees a second
turn to branch from. Supervised fine-tuning on the environment's own demonstrations (`demos.py`: a
tool call, its real observation, the answer) teaches the format first. The loss is the cross-entropy
of the policy's turns only; prompts and observations are masked, exactly as RL masks them, and the
tokens are laid out as the runner lays them out. Held-out tasks (`held_out`, split by the same rule
as `benchmarks/real_learning.py`) are never used. The result is a plain model folder (LoRA merged),
which the trainer, its engines and vLLM load like any other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from trace_lightning import config
from trace_lightning.chat import chat_turns, observation_ids, prompt_ids
from trace_lightning.console import FitProgress, quiet_console
from trace_lightning.demos import Demonstration, demonstrations
from trace_lightning.envs.base import split_tasks
from trace_lightning.model_folder import MARKER, model_tags, policy_options, policy_path
from trace_lightning.models import build_policy
from trace_lightning.run_record import mark_model_training
from trace_lightning.runner import task_prompt_ids

config.register()  # the ${abspath:...} resolver the logger group uses

IGNORE = -100  # label of a token the loss skips (prompt, observation, padding)


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # the token itself where the policy wrote it, IGNORE elsewhere


def to_example(tokenizer: Any, system_prompt: str, demo: Demonstration, env: Any | None = None) -> Example:
    """The demonstration as the runner would have tokenised the episode, turns trainable.

    With `env`, the prompt is the environment's own (`runner.task_prompt_ids`), and an action that ends
    with none of its stop strings (a bfcl reply) ends with EOS, trained too: the engine stops a turn
    there, so the policy must learn to end a reply."""
    if env is None:
        ids = prompt_ids(tokenizer, system_prompt, demo.task.question)
    else:
        ids = task_prompt_ids(tokenizer, env, demo.task)
    labels = [IGNORE] * len(ids)
    stops = tuple(env.stop_strings) if env is not None else ()
    for i, action in enumerate(demo.actions):
        action_ids = list(tokenizer(action, add_special_tokens=False)["input_ids"])
        if stops and not action.rstrip().endswith(stops):
            action_ids.append(tokenizer.eos_token_id)
        ids, labels = ids + action_ids, labels + action_ids
        if i < len(demo.observations):
            obs = observation_ids(tokenizer, demo.observations[i], action_ids)
            ids, labels = ids + obs, labels + [IGNORE] * len(obs)
    return Example(ids, labels)


def select_examples(
    tokenizer: Any, env: Any, demos: Sequence[Demonstration], max_tokens: int | None, max_demos: int | None
) -> list[Example]:
    """The demonstrations as examples, in order: those of at most `max_tokens` tokens (all when None),
    then the first `max_demos` of them (all when None). A token cap keeps a CPU warm start affordable
    where demonstrations run long (a bfcl conversation with its function docs: 1-5k tokens)."""
    examples = [to_example(tokenizer, env.system_prompt, d, env=env) for d in demos]
    if max_tokens is not None:
        examples = [e for e in examples if len(e.input_ids) <= max_tokens]
    return examples[:max_demos]


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels [B, T]."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n], labels[row, :n], mask[row, :n] = torch.tensor(e.input_ids), torch.tensor(e.labels), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class WarmStartModule(L.LightningModule):
    """The policy (LoRA or full weights) trained by cross-entropy on the demonstrated turns."""

    def __init__(
        self,
        model_path: str,
        adapter: Any | None = None,
        lr: float = 2e-4,
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.policy, self.tokenizer = build_policy(model_path, **(options or {}))
        chat_turns(self.tokenizer)  # a tokenizer whose template cannot play episodes is refused here
        if adapter is not None:
            from peft import get_peft_model

            self.policy = get_peft_model(self.policy, adapter)
        self.policy.train()  # from_pretrained returns eval mode
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # transformers shifts the labels: position t is scored on predicting token t + 1
        loss = self.policy(**batch).loss
        self.log("warmstart/loss", loss.detach(), prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad], lr=self.lr)

    def save(self, out_dir: Path, record: dict[str, Any]) -> Path:
        """A plain model folder (adapters merged into the weights), its tokenizer, then the marker."""
        model = self.policy.merge_and_unload() if hasattr(self.policy, "merge_and_unload") else self.policy
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out_dir))
        self.tokenizer.save_pretrained(str(out_dir))
        (out_dir / MARKER).write_text(json.dumps(record, indent=1))
        return out_dir


def run(cfg: DictConfig) -> Path:
    """Build the demonstrations, fine-tune, save; the saved folder."""
    L.seed_everything(cfg.seed, workers=True)
    env = instantiate(cfg.env)
    train_ids, held = split_tasks([t.task_id for t in env.tasks()], cfg.held_out, cfg.seed)
    demos, missing = demonstrations(env, train_ids)
    if not demos:
        raise ValueError(f"env={env.name}: no demonstration replays to reward 1 on the training tasks")
    base = policy_path(cfg.model)
    adapter = instantiate(cfg.adapter) if cfg.adapter is not None else None
    module = WarmStartModule(base, adapter, cfg.lr, policy_options(cfg.model))
    examples = select_examples(module.tokenizer, env, demos, cfg.max_demo_tokens, cfg.max_demos)
    if not examples:
        raise ValueError(f"max_demo_tokens={cfg.max_demo_tokens} leaves no demonstration: raise it, or null")
    pad = module.tokenizer.pad_token_id
    loader = DataLoader(
        examples, batch_size=cfg.batch_size, shuffle=True, collate_fn=lambda b: collate(b, pad)
    )
    logger = _logger(cfg, env.name, len(examples), missing, sorted(held))
    progress = FitProgress(f"warm start: {len(examples)} demonstrations", "warmstart/loss")
    trainer = instantiate(cfg.trainer, logger=logger if logger is not None else False, callbacks=[progress])
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    record = {
        "env": env.name,
        "base_model": model_tags(cfg.model.get("warm_start"), base)["base_model"],
        "demonstrations": len(examples),
        "tasks_without_demonstration": missing,
        "max_demo_tokens": cfg.max_demo_tokens,
        "held_out_task_ids": sorted(held),
        "epochs": cfg.trainer.max_epochs,
        "seconds": round(time.perf_counter() - start, 1),
        "final_loss": float(trainer.callback_metrics.get("warmstart/loss", float("nan"))),
    }
    out = module.save(Path(cfg.out_dir), record)
    if trainer.is_global_zero:
        print(
            f"\nwarm start: {len(examples)} demonstrations ({missing} training tasks had none) on "
            f"{env.name}, {record['epochs']} epochs in {record['seconds']} s, final loss "
            f"{record['final_loss']:.3f}; {len(held)} tasks held out (all in {out / MARKER})"
        )
        print(f"  train on it: python -m trace_lightning.trainer model.warm_start={out.resolve()}")
    return out


def _logger(cfg: DictConfig, env_name: str, n_demos: int, missing: int, held: list[int]) -> Any:
    if cfg.logger is None:
        return None
    logger = instantiate(cfg.logger, run_name=f"warmstart-{env_name}", tags={"stage": "warm_start"})
    mark_model_training(logger)
    params = {"demonstrations": n_demos, "tasks_without_demonstration": missing, "held_out": str(held)}
    params |= {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if not isinstance(v, dict)}
    logger.log_hyperparams(params)
    return logger


@hydra.main(config_path=str(config.conf_dir()), config_name="warmstart", version_base="1.3")
def main(cfg: DictConfig) -> None:
    quiet_console()  # the trainer's console rules: INFO to <run_dir>/warmstart.log, one bar for the fit
    run(cfg)


if __name__ == "__main__":
    main()
