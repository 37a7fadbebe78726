"""Shared pieces of the benchmarks that train: a phase clock and timing proxies around the parts of an
iteration that the benchmark constructs (engine, environment, allocator, the module's scorer and
old-log-prob pass), a plain training loop, the tiny-model setup and process memory.

Nothing in `trace_lightning/` is changed: each proxy forwards every attribute to the object it wraps
and only times the calls named below, so the measured iteration is the library's own code path.

    phase         what is timed                                    where it is called
    generation    engine.generate (prefill + sampling)             ReActRunner._turn
    env           env.step (tool calls, answer scoring)            ReActRunner._step
    predictor     module.scorer.features + predict (scoring)    build_trees, before each stage
    allocation    allocator.allocate_roots / allocate_prefixes     build_trees
    old_logprobs  module.fill_old_logprobs (pi_old forward)        RolloutDataModule._batches
    training      forward + backward + optimizer step per batch    `train_iteration` below
    sync          engine.sync_weights (weight copy to the engine)  `train_iteration`, or the DataModule

None of these calls another, so the phases are disjoint; `PhaseClock` counts an overlap if one ever
starts inside another, and the benchmarks report that count (it must stay 0). Everything else in the
iteration (tokenising observations, tree bookkeeping, advantages, collation) is `other`.
"""

from __future__ import annotations

import functools
import resource
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from peft import LoraConfig
from transformers.utils import logging as hf_logging

from trace_lightning.advantages import TreeGRPO
from trace_lightning.batching import RolloutBatch
from trace_lightning.budget import Budget
from trace_lightning.data import DataSettings, RolloutDataModule
from trace_lightning.engines.base import SamplingParams
from trace_lightning.engines.hf import HFEngine
from trace_lightning.models import build_policy, build_tiny_model
from trace_lightning.module import ModuleSettings, TraceModule
from trace_lightning.predictor import PredictorSettings

PHASES = ("generation", "env", "predictor", "allocation", "old_logprobs", "training", "sync")

# TraceModule.training_step logs through Lightning; outside a Trainer that is a no-op with a warning.
warnings.filterwarnings("ignore", message=".*self.log.*")
hf_logging.disable_progress_bar()  # the tiny model is saved and reloaded per sweep point


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class PhaseClock:
    """Wall seconds and call counts per phase, reset once per iteration."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.details: defaultdict[str, float] = defaultdict(float)  # a finer split inside one phase
        self.overlaps = 0
        self._active: str | None = None

    @contextmanager
    def phase(self, name: str, detail: str | None = None) -> Iterator[None]:
        if self._active is not None:  # a phase inside another would be counted twice
            self.overlaps += 1
        outer, self._active = self._active, name
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.seconds[name] += seconds
            self.calls[name] += 1
            if detail is not None:
                self.details[detail] += seconds
            self._active = outer

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)

        return timed

    def split(self, total: float) -> dict[str, float]:
        """Seconds per phase (every phase present, 0 when unused) plus `other` = total - named."""
        row = {p: self.seconds.get(p, 0.0) for p in PHASES}
        row["other"] = total - sum(row.values())
        return row

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.details.clear()


class _Proxy:
    """Forwards every attribute to the wrapped object; subclasses time the calls they define."""

    def __init__(self, inner: Any, clock: PhaseClock) -> None:
        self.inner, self.clock = inner, clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TaskSubset:
    """An environment restricted to some of its tasks (training tasks vs held-out tasks)."""

    def __init__(self, inner: Any, task_ids: set[int]) -> None:
        self.inner, self.task_ids = inner, task_ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def tasks(self) -> list[Any]:
        return [t for t in self.inner.tasks() if t.task_id in self.task_ids]


class TimedEngine(_Proxy):
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.phase("generation"):
            return self.inner.generate(*args, **kwargs)

    def sync_weights(self) -> None:
        """A no-op for HFEngine (it samples from the trained module); a real copy for vLLM."""
        with self.clock.phase("sync"):
            self.inner.sync_weights()


class TimedEnv(_Proxy):
    def step(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.phase("env"):
            return self.inner.step(*args, **kwargs)


class TimedAllocator(_Proxy):
    def allocate_roots(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.phase("allocation"):
            return self.inner.allocate_roots(*args, **kwargs)

    def allocate_prefixes(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.phase("allocation"):
            return self.inner.allocate_prefixes(*args, **kwargs)


def _hf(model: Any, tokenizer: Any, max_batch_size: int) -> Any:
    return HFEngine(model, tokenizer, max_batch_size=max_batch_size)


def _vllm(model: Any, tokenizer: Any, max_batch_size: int) -> Any:
    """Needs vLLM (`make install-vllm`, its own venv); vLLM batches by itself, so no batch size."""
    from trace_lightning.engines.vllm import VLLMEngine

    return VLLMEngine(model, tokenizer, enforce_eager=True)


# Engines the benchmarks can run. An engine's `sync_weights` (the real weight copy for vLLM, a no-op for
# HFEngine) goes through `TimedEngine`, whoever calls it, and lands in the `sync` phase.
ENGINES: dict[str, Callable[..., Any]] = {"hf": _hf, "vllm": _vllm}


class TimedEngineFactory:
    """What RolloutDataModule calls to build its engine; keeps the (timed) engine for `sync_weights`."""

    def __init__(self, name: str, clock: PhaseClock, max_batch_size: int) -> None:
        if name not in ENGINES:
            raise ValueError(f"--engine {name!r} is not available here; use one of {sorted(ENGINES)}")
        self.cls, self.clock, self.max_batch_size = ENGINES[name], clock, max_batch_size
        self.engine: TimedEngine | None = None

    def __call__(self, model: Any, tokenizer: Any) -> TimedEngine:
        self.engine = TimedEngine(self.cls(model, tokenizer, self.max_batch_size), self.clock)
        return self.engine


def instrument_module(module: TraceModule, clock: PhaseClock) -> None:
    """Time the module's scorer and pi_old pass: instance attributes shadow the methods. Each call wraps
    the class's own method, so instrumenting again replaces the clock instead of nesting two. Scoring is
    split into roots (the whole candidate pool, every node id 0) and prefixes (Stage 2 candidates)."""
    scorer, cls = module.scorer, type(module.scorer)
    features = cls.features.__get__(scorer)

    def prefix_features(trees: Any, node_ids: Any) -> Any:  # what the DataModule's scorer reads
        part = "predictor_roots" if all(list(n) == [0] for n in node_ids) else "predictor_prefixes"
        with clock.phase("predictor", detail=part):
            return features(trees, node_ids)

    scorer.features = prefix_features  # type: ignore[method-assign]
    scorer.predict = clock.wrap("predictor", cls.predict.__get__(scorer))  # type: ignore[method-assign]
    old = type(module).fill_old_logprobs.__get__(module)
    module.fill_old_logprobs = clock.wrap("old_logprobs", old)  # type: ignore[method-assign]


def train_iteration(
    module: TraceModule,
    optimizer: torch.optim.Optimizer,
    batches: list[RolloutBatch],
    clock: PhaseClock,
    engine: TimedEngine | None,
    clip: float = 1.0,
) -> list[float]:
    """One optimizer step per micro-batch, as the Trainer runs it (conf/trainer/cpu.yaml:
    accumulate_grad_batches 1, gradient_clip_val 1.0), then the engine's weight sync. Returns losses.

    A DataModule that syncs the engine itself before sampling (when the weights changed) has already
    done so inside this iteration's `build_iteration`, through the same timed proxy; the sync here is
    then skipped, so every iteration pays for exactly one sync either way."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    losses = []
    with clock.phase("training"):
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = module.training_step(batch, 0)
            if loss is None:  # a non-finite loss: the module drops the batch
                continue
            loss.backward()
            module.on_before_optimizer_step(optimizer)
            torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            losses.append(float(loss.detach()))
    if engine is not None and not clock.calls["sync"]:  # unless the DataModule synced it this iteration
        engine.sync_weights()
    return losses


def lora_config(rank: int, targets: tuple[str, ...]) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.0)


def bench_module(
    path: str, optimizer: Any, sampling: SamplingParams, adapter: Any = None, width: int = 16
) -> TraceModule:
    """The module the benchmarks train: the policy at `path` and the joint-loss head (coef 1, read at the
    prefix's last state), scoring at `sampling`'s temperature. Every step moves AdamW, contrast or not
    (`hold_on_zero_gradient=False`): the cost benchmarks time an update and the weight sync after it."""
    head = PredictorSettings.policy_state(
        width=width, coef=1.0, pooling="last", standardize=False, refit_steps=0
    )
    settings = ModuleSettings(hold_on_zero_gradient=False)
    policy = build_policy(path, adapter)
    return TraceModule(policy, optimizer, sampling=sampling, predictor=head, settings=settings)


def bench_data(
    env: Any,
    allocator: Any,
    engine: Any,
    sampling: SamplingParams,
    leaves: int,
    max_tokens: int | None = None,
    estimator: Any = TreeGRPO(),
    **settings: Any,
) -> RolloutDataModule:
    """A RolloutDataModule; `settings` are DataSettings fields (micro-batches by count unless given, one
    optimizer step per micro-batch as `train_iteration` runs them, unless given)."""
    settings = {"micro_batch_tokens": None, "steps_per_iteration": None, **settings}
    return RolloutDataModule(
        env,
        allocator,
        engine,
        sampling=sampling,
        budget=Budget(leaves, max_tokens),
        settings=DataSettings(**settings),
        estimator=estimator,
    )


def tiny_module(
    out_dir: str, lr: float, seed: int = 0, sampling: SamplingParams = SamplingParams(12, 1.0)
) -> TraceModule:
    """A 2-layer random Qwen3 (hidden 64) with LoRA: the model the quick modes and the sweep use."""
    path = build_tiny_model(out_dir, seed=seed)
    optimizer = functools.partial(torch.optim.AdamW, lr=lr)
    return bench_module(path, optimizer, sampling, lora_config(4, ("q_proj", "v_proj")))
