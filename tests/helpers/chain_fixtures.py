"""The chain-task fixtures the module, data and collector tests share: a tiny random Qwen3 policy with
the joint-loss head, and a RolloutDataModule on the chain task."""

import dataclasses
import functools

import torch
from peft import LoraConfig

from helpers import quiet_trainer
from trace_lightning import allocation as alloc
from trace_lightning.budget import Budget
from trace_lightning.data import DataSettings, RolloutDataModule
from trace_lightning.engines.base import SamplingParams
from trace_lightning.engines.hf import HFEngine
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.losses import LossSettings
from trace_lightning.models import build_policy
from trace_lightning.module import ModuleSettings, TraceModule
from trace_lightning.predictor import PredictorSettings

SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0)


# The joint-loss head (coef > 0 reads the last state), which these tests train with the policy.
HEAD = PredictorSettings.policy_state(width=16, coef=1.0, pooling="last", standardize=False, refit_steps=0)


DATA = DataSettings(
    pool_size=8, micro_batch_size=4, micro_batch_tokens=None, max_turns=3, max_episode_tokens=96
)


def make_module(
    model_dir,
    adapter=None,
    kl_coef=0.0,
    companion=None,
    temperature=SAMPLING.temperature,
    settings=ModuleSettings(),
    **head,
):
    """`head`: PredictorSettings fields that differ from HEAD."""
    lora = (
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        if adapter
        else None
    )
    return TraceModule(
        build_policy(model_dir, lora),
        functools.partial(torch.optim.AdamW, lr=1e-2),
        sampling=SamplingParams(SAMPLING.max_new_tokens, temperature),
        loss=LossSettings(kl_coef=kl_coef),
        predictor=dataclasses.replace(HEAD, **head),
        companion=build_policy(companion) if companion is not None else None,
        settings=settings,
    )


def make_data(
    allocator=None,
    leaves=12,
    max_tokens=None,
    engine=None,
    sampling=SAMPLING,
    held_out=0,
    settings=DATA,
    unit="leaves",
    env=None,
    **kw,
):
    return RolloutDataModule(
        env=env or ChainEnv(n_tasks=24, turns=3, seed=0),
        allocator=allocator or alloc.trace(expansion=2, max_per_prompt=4),
        engine=engine or functools.partial(HFEngine, max_batch_size=16),
        sampling=sampling,
        budget=Budget(leaves, max_tokens, unit),
        settings=dataclasses.replace(settings, held_out=held_out),
        **kw,
    )


def fit(module, data, epochs=2, callbacks=()):
    trainer = quiet_trainer(max_epochs=epochs, callbacks=list(callbacks))
    trainer.fit(module, datamodule=data)
    return trainer
