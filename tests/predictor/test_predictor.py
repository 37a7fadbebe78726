"""The success predictor's online refit: input standardisation, replay, head-only steps."""

import copy
import functools

import numpy as np
import pytest
import torch
from helpers.chain_fixtures import make_data, make_module

from trace_lightning import allocation as alloc
from trace_lightning.metrics import calibration_metrics
from trace_lightning.predictor import FeatureScaler, PredictorFit, ReplayEntry, SuccessHead
from trace_lightning.selection import Selection


def near_identical_prompts(n=64, size=32, seed=0):
    """Features that share one big direction and differ by ~1e-3 of their norm, as the policy's final
    states did after the warm start; the target success depends only on the small part."""
    g = torch.Generator().manual_seed(seed)
    common = 10 * torch.randn(size, generator=g)
    signal = torch.randn(n, generator=g)
    direction = torch.nn.functional.normalize(torch.randn(size, generator=g), dim=0)
    x = common + 1e-2 * signal[:, None] * direction + 1e-3 * torch.randn(n, size, generator=g)
    return x, torch.sigmoid(2 * signal)


def test_scaler_standardises_across_prompts():
    x, _ = near_identical_prompts()
    scaler = FeatureScaler(x.shape[1])
    scaler.update(x)
    z = scaler(x)
    assert z.mean(0).abs().max() < 1e-3
    assert torch.allclose(z.var(0), torch.ones(x.shape[1]), atol=1e-3)


def test_standardised_head_ranks_near_identical_prompts():
    x, y = near_identical_prompts()
    torch.manual_seed(0)
    head = SuccessHead(x.shape[1], width=32, standardize=True)
    head.scaler.update(x)
    fit = PredictorFit(steps=300, window=4, batch_size=64, lr=1e-2)
    fit.add(0, ReplayEntry(0, x, y, torch.ones(len(y))))
    fit.fit(head, 0)
    with torch.no_grad():
        pred = torch.sigmoid(head(x))
    assert np.corrcoef(pred.numpy(), y.numpy())[0, 1] > 0.9


def entry(iteration, value):
    return ReplayEntry(iteration, torch.full((1, 3), float(value)), torch.tensor([value]), torch.ones(1))


def test_replay_keeps_the_latest_targets_per_prompt_within_the_window():
    fit = PredictorFit(window=2)
    fit.add(1, entry(0, 0.0))
    fit.add(1, entry(2, 1.0))  # a later visit of prompt 1 replaces its targets
    fit.add(2, entry(1, 0.5))
    _, y, _ = fit.training_set(2)
    assert sorted(y.tolist()) == [0.5, 1.0]
    _, y, _ = fit.training_set(3)  # prompt 2's iteration 1 has left the window of 2
    assert y.tolist() == [1.0]


def test_refit_state_round_trip_continues_identically():
    x, y = near_identical_prompts(16, 8)
    torch.manual_seed(0)
    head = SuccessHead(8, width=8, standardize=True)
    a = PredictorFit(steps=5, batch_size=4, lr=1e-2, seed=3)
    a.add(0, ReplayEntry(0, x, y, torch.ones(len(y))))
    a.fit(head, 0)
    saved_head, saved = copy.deepcopy(head), copy.deepcopy(a.state_dict())
    a.fit(head, 0)
    b = PredictorFit(steps=5, batch_size=4, lr=1e-2, seed=99)
    b.load_state_dict(saved)
    b.fit(saved_head, 0)
    for p, q in zip(head.parameters(), saved_head.parameters(), strict=True):
        assert torch.equal(p, q)


def test_bad_refit_values_name_their_key():
    with pytest.raises(ValueError, match="predictor.refit_steps"):
        PredictorFit(steps=-1)


def test_iteration_refits_the_head_before_training_and_reports_quality(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, coef=0.0, standardize=True)
    data = make_data(
        predictor_fit=PredictorFit(steps=5, batch_size=16),
        selection=Selection(explore_groups=1, gate_skill=0.05),
        cold_start=alloc.BetaPrior(warmup=1),
    )
    before = copy.deepcopy(module.head.state_dict())
    data.build_iteration(module)
    assert int(module.head.scaler.seen) == 1  # the pool's root features set the statistics
    moved = [not torch.equal(before[k], v) for k, v in module.head.state_dict().items() if "net" in k]
    assert any(moved), "the head must change in the refit, with no policy step"
    report = data.report
    assert np.isfinite(report.refit_loss)
    assert set(data.collector.predictor_fit.replay) == {t.task_id for t in report.result.trees}
    roots = {t.task_id: t for t in report.result.trees}
    for task_id, e in data.collector.predictor_fit.replay.items():  # row 0 is the root: bare rollouts only
        bare = [
            roots[task_id].nodes[x].reward
            for x in roots[task_id].leaves()
            if roots[task_id].nodes[x].stage == "bare"
        ]
        assert e.targets[0].item() == pytest.approx(np.mean(bare))
    metrics = calibration_metrics(report)
    assert metrics["predictor/gate"] == 0.0  # no evidence yet: the gate starts closed
    assert "predictor/pool_spread" in metrics and "predictor/refit_loss" in metrics


def test_head_is_left_out_of_the_policy_optimizer_when_only_the_refit_trains_it(tiny_model_dir):
    module = make_module(tiny_model_dir, coef=0.0)
    params = {id(p) for g in module.configure_optimizers().param_groups for p in g["params"]}
    assert not any(id(p) in params for p in module.head.parameters())
    joint = make_module(tiny_model_dir, coef=1.0)
    params = {id(p) for g in joint.configure_optimizers().param_groups for p in g["params"]}
    assert all(id(p) in params for p in joint.head.parameters())


def test_posterior_features_reach_the_head(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, coef=0.0, posterior_features=True)
    data = make_data(predictor_fit=PredictorFit(steps=2), cold_start=alloc.BetaPrior(warmup=0))
    data.build_iteration(module)
    width = module.scorer.width + 2
    assert all(e.features.shape[1] == width for e in data.collector.predictor_fit.replay.values())
    with pytest.raises(ValueError, match="predictor.coef"):
        functools.partial(make_module, tiny_model_dir)(coef=1.0, posterior_features=True)


def test_mean_pooled_features_match_a_plain_forward(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, coef=0.0, pooling="last_mean")
    data = make_data(cold_start=alloc.BetaPrior(warmup=1))
    data.build_iteration(module)
    trees = data.report.result.trees
    nodes = [[0, *[n.id for n in t.nodes[1:]]] for t in trees]
    got = module.scorer.features(trees, nodes)
    for tree, ids, feats in zip(trees, nodes, got, strict=True):
        for n, row in zip(ids, feats, strict=True):
            seq = torch.tensor([tree.token_ids(n)])
            with torch.no_grad():
                states = module.policy(input_ids=seq, output_hidden_states=True).hidden_states[-1][
                    0
                ]  # [T, H]
            expected = torch.cat([states[-1], states.mean(0)])  # the last state, then the mean of all of them
            assert torch.allclose(row, expected, atol=1e-5), (tree.task_id, n)


# ------------------------------------------------------------------ text features and label age


def test_ngram_features_mark_each_hashed_unigram_and_bigram():
    from trace_lightning.predictor.features import ngram_features

    got = ngram_features([5, 7], buckets=8)
    # unigrams 5 and 7; the bigram (5, 7) hashes to (5 * 1_000_003 + 7 + 1) % 8 = 3
    assert torch.nonzero(got).flatten().tolist() == sorted({5, 7, (5 * 1_000_003 + 8) % 8})
    assert ngram_features([5, 7], 8).equal(got) and ngram_features([7, 5], 8).sum() == 3


def test_text_columns_bypass_the_standardiser():
    """The scaler sees only the policy columns: a text column no root had must not blow up."""
    torch.manual_seed(0)
    head = SuccessHead(4, width=8, standardize=True, raw=3)
    roots = torch.cat([torch.randn(16, 4), torch.zeros(16, 3)], dim=1)
    head.scaler.update(roots[:, :4])
    prefix = torch.cat([torch.randn(1, 4), torch.ones(1, 3)], dim=1)  # text columns roots never had
    expected = head.net[1:](torch.cat([head.scaler(prefix[:, :4]), prefix[:, 4:]], dim=1)).squeeze(-1)
    assert torch.allclose(head(prefix), expected) and head(prefix).abs().item() < 100


def test_older_labels_weigh_less_with_label_decay():
    fit = PredictorFit(window=8, label_decay=0.5)
    fit.add(1, entry(2, 1.0))
    fit.add(2, ReplayEntry(4, torch.zeros(1, 3), torch.tensor([0.0]), torch.tensor([3.0])))
    _, y, w = fit.training_set(4)
    assert dict(zip(y.tolist(), w.tolist(), strict=True)) == {1.0: 0.25, 0.0: 3.0}  # 1 * 0.5^2, 3 * 0.5^0
    with pytest.raises(ValueError, match="predictor.label_decay"):
        PredictorFit(label_decay=0.0)


def test_a_text_only_head_scores_and_refits_through_an_iteration(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, coef=0.0, standardize=True, text_buckets=32, policy_features=False)
    assert module.scorer.width == 32 and module.head.scaled == 0
    data = make_data(predictor_fit=PredictorFit(steps=3), cold_start=alloc.BetaPrior(warmup=0))
    data.build_iteration(module)
    assert all(e.features.shape[1] == 32 for e in data.collector.predictor_fit.replay.values())
    assert np.isfinite(data.report.refit_loss)
    with pytest.raises(ValueError, match="predictor.policy_features"):
        make_module(tiny_model_dir, coef=0.0, policy_features=False)  # nothing left to read


def test_platt_calibration_shrinks_an_over_confident_head_and_keeps_its_ranking():
    """Outcomes drawn at rates 0.3 and 0.7 while the head says 0.05 and 0.95: the fitted map moves its
    predictions towards the true rates (the maximum-likelihood map on these counts is a = logit(0.7) /
    logit(0.95), c = 0; the ridge keeps it a little closer to the identity)."""
    from trace_lightning.predictor.calibration import PlattCalibration, logit

    cal = PlattCalibration(window=4, strength=1.0)
    for it in range(4):  # 4 iterations, each 100 rollouts of a 0.05-predicted and a 0.95-predicted prompt
        cal.observe(it, [0.05, 0.95], [30, 70], [100, 100])
    mle_a = float(logit(np.array([0.7]))[0] / logit(np.array([0.95]))[0])
    assert cal.c == pytest.approx(0.0, abs=1e-9) and mle_a < cal.a < mle_a * 1.05
    got = cal(np.array([0.05, 0.5, 0.95]))
    assert got[0] == pytest.approx(0.3, abs=0.02) and got[2] == pytest.approx(0.7, abs=0.02) and got[1] == 0.5
    cal.observe(10, [0.5], [1], [2])  # the window forgets the old evidence: back near the identity
    assert cal.a == pytest.approx(1.0, abs=0.1) and len(cal.history) == 1
