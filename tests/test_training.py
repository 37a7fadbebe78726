"""The LLM path end to end on a tiny random Qwen3: runner, module, DataModule, Lightning."""

import dataclasses
import functools

import lightning as L
import numpy as np
import pytest
import torch
from helpers import quiet_trainer
from peft import LoraConfig

from trace_lightning import allocation as alloc
from trace_lightning.allocation import Budget
from trace_lightning.collector import fingerprint
from trace_lightning.data import DataSettings, RolloutDataModule
from trace_lightning.engines.base import Completion, EngineStats, SamplingParams
from trace_lightning.engines.hf import HFEngine
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.losses import LossSettings, predictor_mse
from trace_lightning.models import build_policy
from trace_lightning.module import TraceModule
from trace_lightning.predictor import PredictorSettings

SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0)


# The joint-loss head (coef > 0 reads the last state), which these tests train with the policy.
HEAD = PredictorSettings(width=16, coef=1.0, pooling="last", standardize=False, refit_steps=0)
DATA = DataSettings(
    pool_size=8, micro_batch_size=4, micro_batch_tokens=None, max_turns=3, max_episode_tokens=96
)


def make_module(
    model_dir, adapter=None, kl_coef=0.0, companion=None, temperature=SAMPLING.temperature, **head
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
    )


def make_data(allocator=None, leaves=12, max_tokens=None, engine=None, sampling=SAMPLING, **kw):
    return RolloutDataModule(
        env=ChainEnv(n_tasks=24, turns=3, seed=0),
        allocator=allocator or alloc.trace(expansion=2, max_per_prompt=4),
        engine=engine or functools.partial(HFEngine, max_batch_size=16),
        sampling=sampling,
        budget=Budget(leaves, max_tokens),
        settings=DATA,
        **kw,
    )


class Recorder(L.Callback):
    """Weights at each epoch end, and whether the first update of each epoch was exactly on-policy."""

    def __init__(self):
        self.end_fingerprints, self.first_ratio_exact, self.generated_with = [], [], []

    def on_train_epoch_start(self, trainer, module):
        self.generated_with.append(trainer.datamodule.report.policy_fingerprint)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 0:
            with torch.no_grad():
                logp, _ = module._batch_forward(module.policy, batch)  # the forward training_step runs
            keep = batch.loss_mask.bool()
            self.first_ratio_exact.append(bool(torch.equal(logp[keep], batch.old_logprobs[keep])))

    def on_train_epoch_end(self, trainer, module):
        self.end_fingerprints.append(fingerprint(module))


def fit(module, data, epochs=2, callbacks=()):
    trainer = quiet_trainer(max_epochs=epochs, callbacks=list(callbacks))
    trainer.fit(module, datamodule=data)
    return trainer


def test_full_iterations_through_lightning_are_on_policy(tiny_model_dir):
    torch.manual_seed(0)
    module, data, rec = make_module(tiny_model_dir), make_data(), Recorder()
    fit(module, data, epochs=3, callbacks=[rec])
    # the batch of epoch k was sampled by the weights that epoch k-1 ended with
    assert rec.generated_with[1:] == rec.end_fingerprints[:-1]
    assert rec.generated_with[0] != rec.end_fingerprints[0]  # and training did change them
    assert rec.first_ratio_exact == [True, True, True]
    report = data.report
    assert report.iteration == 2 and data.collector.iteration == 3
    assert sum(len(t.leaves()) for t in report.result.trees) == report.result.ledger.leaves_used == 12


def test_lora_trains_only_adapters_and_head(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, adapter=True)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    fit(module, make_data(), epochs=1)
    changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert changed, "nothing trained"
    assert all("lora_" in n or n.startswith("head.") for n in changed), sorted(changed)[:5]
    assert any("lora_" in n for n in changed) and any(n.startswith("head.") for n in changed)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert all("lora_" in n or n.startswith("head.") for n in trainable)


def test_full_finetuning_changes_base_weights(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    w = module.policy.model.layers[0].mlp.up_proj.weight.detach().clone()
    fit(module, make_data(), epochs=1)
    assert not torch.equal(w, module.policy.model.layers[0].mlp.up_proj.weight)


def test_kl_reference_is_the_base_model_with_lora(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, adapter=True, kl_coef=0.1)
    trainer = fit(module, make_data(), epochs=1)
    assert module.reference is None  # LoRA: no copy, the adapters are disabled instead
    kl = trainer.callback_metrics["train/kl"]
    assert torch.isfinite(kl) and kl >= 0


def test_observation_and_prompt_tokens_never_receive_loss(tiny_model_dir):
    torch.manual_seed(0)
    module, data = make_module(tiny_model_dir), make_data()
    batch = data.build_iteration(module)[0]
    loss = module.training_step(batch, 0)
    # garbage advantages and old log-probs on every masked position change nothing
    noisy = type(batch)(**vars(batch))
    masked = batch.loss_mask == 0
    noisy.advantages = torch.where(masked, torch.randn_like(batch.advantages) * 1e3, batch.advantages)
    noisy.old_logprobs = torch.where(masked, torch.randn_like(batch.old_logprobs), batch.old_logprobs)
    assert module.training_step(noisy, 0).item() == pytest.approx(loss.item(), abs=1e-6)
    tree = data.report.result.trees[0]
    obs_tokens = sum(len(n.obs_ids) for n in tree.nodes)
    assert obs_tokens > 0  # the check above is not vacuous


def test_real_rollout_trees_respect_leaf_and_token_budgets(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    for allocator in (alloc.uniform(4), alloc.trace(2, max_per_prompt=4), alloc.random_expand(2, 2)):
        data = make_data(allocator=allocator, max_tokens=150)
        data.build_iteration(module)
        res = data.report.result
        assert sum(len(t.leaves()) for t in res.trees) == 12
        assert res.ledger.tokens_used <= 150
        assert res.ledger.tokens_used == sum(len(n.action_ids) for t in res.trees for n in t.nodes)


class SpyEngine(HFEngine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prompts = []

    def generate(self, prompts, params):
        self.prompts += [list(p) for p in prompts]
        return super().generate(prompts, params)


def test_branching_reenters_exact_prefix_tokens_and_env_state(tiny_model_dir):
    torch.manual_seed(1)
    module = make_module(tiny_model_dir)
    env = ChainEnv(n_tasks=24, turns=3, seed=0)
    seen_states = []
    real_step = env.step
    env.step = lambda task, state, text: (
        seen_states.append((task.task_id, state)),
        real_step(task, state, text),
    )[1]
    data = make_data(engine=functools.partial(SpyEngine, max_batch_size=16))
    data.collector.env = env
    data.build_iteration(module)
    trees = data.report.result.trees
    spy = data.collector.runner.engine
    expand_roots = [
        (t, n) for t in trees for n in t.nodes if n.stage == "expand" and t.nodes[n.parent].stage == "bare"
    ]
    assert expand_roots, "no continuation from a turn prefix was sampled"
    for tree, node in expand_roots:
        prefix = tree.token_ids(node.parent)
        assert prefix in spy.prompts  # the engine was given exactly the prefix's tokens
        assert (tree.task_id, tree.env_states[node.parent]) in seen_states  # and the env its state there
        assert tree.token_ids(node.id)[: len(prefix)] == prefix


def test_predictor_loss_falls_on_fixed_targets(tiny_model_dir):
    torch.manual_seed(0)
    module, data = make_module(tiny_model_dir), make_data()
    batches = data.build_iteration(module)
    opt = torch.optim.Adam(module.head.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        total = 0.0
        for b in batches:
            with torch.no_grad():
                _, hidden = module._forward(module.policy, b.input_ids, b.attention_mask)
            pred = torch.sigmoid(module.head(hidden[b.pred_rows, b.pred_cols]))
            loss = predictor_mse(pred, b.pred_targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        losses.append(total)
    assert losses[-1] < 0.5 * losses[0]


class ScriptedEngine:
    """Returns adversarial turns (as tokens of the real tokenizer) in a fixed cycle."""

    TEXTS = (
        "",
        "<choose>",
        "</choose>",
        "<choose></choose>",
        "<choose>ZZZ</choose>",
        "\x00\ufffd🙂" * 20,
        "<choose>" + "A" * 5000 + "</choose>",
        "<answer>A</answer>",
        "<choose>B</choose><choose>C</choose>",
    )

    def __init__(self, model, tokenizer):
        self.tokenizer, self.stats, self.i = tokenizer, EngineStats(), 0

    def generate(self, prompts, params):
        out = []
        for _ in prompts:
            ids = self.tokenizer(self.TEXTS[self.i % len(self.TEXTS)], add_special_tokens=False)["input_ids"]
            self.i += 1
            out.append(Completion(ids, [0.0] * len(ids), "stop"))
        return out

    def sync_weights(self):
        pass


def test_malformed_and_adversarial_actions_never_crash_a_rollout(tiny_model_dir):
    module = make_module(tiny_model_dir)
    data = make_data(engine=ScriptedEngine, allocator=alloc.uniform(4))
    batches = data.build_iteration(module)
    counters = data.report.counters
    assert batches and counters.format_errors > 0
    assert sum(counters.stop_reasons.values()) == 12
    assert np.isfinite(sum(module.training_step(b, 0).item() for b in batches))


def test_datamodule_state_dict_replays_the_next_iteration_exactly(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    first = make_data()
    first.build_iteration(module)  # move every generator past its start
    state = first.state_dict()
    first.build_iteration(module)
    expected = [(t.task_id, t.token_ids(leaf)) for t in first.report.result.trees for leaf in t.leaves()]
    resumed = make_data(seed=123)  # a different seed: everything must come from the state
    resumed.load_state_dict(state)
    resumed.build_iteration(module)
    got = [(t.task_id, t.token_ids(leaf)) for t in resumed.report.result.trees for leaf in t.leaves()]
    assert got == expected and resumed.collector.iteration == first.collector.iteration == 2


def test_companion_predictor_is_frozen_and_feeds_the_head(tiny_model_dir, tmp_path):
    from trace_lightning.models import build_tiny_model

    companion_dir = build_tiny_model(tmp_path / "companion", hidden_size=32, seed=7)
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, companion=companion_dir)
    assert module.head.net[1].in_features == 32  # sized for the companion, not the policy (64)
    frozen = {n: p.detach().clone() for n, p in module.companion.named_parameters()}
    head = {n: p.detach().clone() for n, p in module.head.named_parameters()}
    fit(module, make_data(), epochs=1)
    assert all(torch.equal(p, frozen[n]) for n, p in module.companion.named_parameters())
    assert any(not torch.equal(p, head[n]) for n, p in module.head.named_parameters())


def test_scoring_with_a_shared_prompt_prefix_matches_plain_forward_passes(tiny_model_dir, monkeypatch):
    """The pool's common prefix runs once and its KV cache is shared; the scores must not change, for
    roots and for prefixes deeper in rollouts, with LoRA and without."""
    from trace_lightning import module as module_lib

    for adapter in (None, "lora"):
        torch.manual_seed(0)
        module, data = make_module(tiny_model_dir, adapter=adapter), make_data()
        data.build_iteration(module)
        trees = data.report.result.trees
        nodes = [[0, *(n.id for n in t.nodes[1:] if n.reward is None)] for t in trees]
        runner = data.collector.runner
        pool = [runner.new_tree(t) for t in sorted(runner.tasks)[:12]]
        assert module_lib._common_prefix_len([t.prompt_ids for t in pool]) >= module_lib.MIN_SHARED_PREFIX
        shared = module.predict_success(trees, nodes) + module.predict_success(pool, [[0]] * len(pool))
        monkeypatch.setattr(module_lib, "MIN_SHARED_PREFIX", 10**9)
        plain = module.predict_success(trees, nodes) + module.predict_success(pool, [[0]] * len(pool))
        monkeypatch.undo()
        for a, b in zip(shared, plain, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
