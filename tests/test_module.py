"""TraceModule on a tiny random Qwen3: what trains (LoRA or full), the KL reference, the loss mask,
the predictor head (joint loss, companion backbone) and shared-prefix scoring."""

import numpy as np
import pytest
import torch
from helpers.chain_fixtures import fit, make_data, make_module

from trace_lightning.losses import predictor_mse
from trace_lightning.module import ModuleSettings


def test_lora_trains_only_adapters_and_head(tiny_model_dir):
    torch.manual_seed(0)
    # the random policy never succeeds on the chain, so every advantage is 0: with the zero-gradient hold
    # off, AdamW's weight decay is what moves the adapters, which is enough to see which weights train
    module = make_module(tiny_model_dir, adapter=True, settings=ModuleSettings(hold_on_zero_gradient=False))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    fit(module, make_data(), epochs=1)
    changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert changed, "nothing trained"
    assert all("lora_" in n or n.startswith("head.") for n in changed), sorted(changed)[:5]
    assert any("lora_" in n for n in changed) and any(n.startswith("head.") for n in changed)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert all("lora_" in n or n.startswith("head.") for n in trainable)


def test_a_step_without_signal_leaves_the_policy_and_its_adam_state_alone(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, adapter=True)  # hold_on_zero_gradient is on by default
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    trainer = fit(module, make_data(), epochs=1)
    assert trainer.callback_metrics["train/held_zero_gradient"] == 1.0  # every leaf failed: no signal
    for n, p in module.policy.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, before[n]), n  # no momentum step, no weight decay
            assert p not in trainer.optimizers[0].state  # AdamW never took a step for it
    head_state = [trainer.optimizers[0].state[p] for p in module.head.parameters()]
    assert all(s["step"] > 0 for s in head_state)  # the head still learned from its own targets


def test_full_finetuning_changes_base_weights(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, settings=ModuleSettings(hold_on_zero_gradient=False))
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
    from trace_lightning.predictor import features as features_lib

    for adapter in (None, "lora"):
        torch.manual_seed(0)
        module, data = make_module(tiny_model_dir, adapter=adapter), make_data()
        data.build_iteration(module)
        trees = data.report.result.trees
        nodes = [[0, *(n.id for n in t.nodes[1:] if n.reward is None)] for t in trees]
        runner = data.collector.runner
        pool = [runner.new_tree(t) for t in sorted(runner.tasks)[:12]]
        assert features_lib.common_prefix_len([t.prompt_ids for t in pool]) >= features_lib.MIN_SHARED_PREFIX

        def predict(trees, nodes, scorer=module.scorer):
            return [scorer.predict(f) for f in scorer.features(trees, nodes)]

        shared = predict(trees, nodes) + predict(pool, [[0]] * len(pool))
        monkeypatch.setattr(features_lib, "MIN_SHARED_PREFIX", 10**9)
        plain = predict(trees, nodes) + predict(pool, [[0]] * len(pool))
        monkeypatch.undo()
        for a, b in zip(shared, plain, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
