import numpy as np
import pytest
import torch

from trace_lightning.advantages import GRPO, TreeGRPO, TreeSegment, node_advantages
from trace_lightning.batching import Batching, collate, leaf_sequences, step_layout
from trace_lightning.tree import RolloutTree


def two_trees() -> list[RolloutTree]:
    """Tree 0: root -> a -> b (1), a -> c (0, expand), root -> d (0). Tree 1: one leaf (1)."""
    t = RolloutTree(task_id=0, prompt_ids=[100, 101])
    a = t.add_turn(0, "bare", [1, 2], [3])
    t.finish(t.add_turn(a, "bare", [4], []), 1.0, "answer")
    t.finish(t.add_turn(0, "bare", [5], []), 0.0, "answer")
    t.finish(t.add_turn(a, "expand", [8, 9], []), 0.0, "answer")
    u = RolloutTree(task_id=1, prompt_ids=[102])
    u.finish(u.add_turn(0, "bare", [6], []), 1.0, "answer")
    return [t, u]


def test_grpo_node_advantages_by_hand():
    # tree 0 leaves (ids 2, 3, 4) rewards 1, 0, 0: mean 1/3, unbiased std sqrt(1/3)
    # -> b = (2/3)/0.57735 = 1.1547, d = c = -0.57735; node a = mean(b, c) = 0.2887
    a0, a1 = node_advantages(two_trees(), GRPO())
    s = np.sqrt(1 / 3) + 1e-6
    np.testing.assert_allclose(a0[2], (2 / 3) / s, rtol=1e-5)
    np.testing.assert_allclose(a0[[3, 4]], [-(1 / 3) / s] * 2, rtol=1e-5)
    np.testing.assert_allclose(a0[1], ((2 / 3) / s - (1 / 3) / s) / 2, rtol=1e-5)
    assert a1.tolist() == [0.0, 0.0]  # a single-leaf group has no contrast


def test_tree_grpo_local_group_is_the_bare_rollout_subtree():
    a0, _ = node_advantages(two_trees(), TreeGRPO())
    g, _ = node_advantages(two_trees(), GRPO())
    # local groups: {b, c} under a (rewards 1, 0: +-0.7071), {d} alone (0)
    assert a0[2] == pytest.approx(g[2] + 0.70710, abs=1e-4)
    assert a0[4] == pytest.approx(g[4] - 0.70710, abs=1e-4)
    assert a0[3] == pytest.approx(g[3])


def test_tree_grpo_shared_prefix_sum_weighs_a_prefix_once_per_leaf():
    mean, _ = node_advantages(two_trees(), TreeGRPO())
    total, _ = node_advantages(two_trees(), TreeGRPO(shared_prefix="sum"))
    # leaves keep their own advantage; node a (above leaves b and c) gets A(b) + A(c), not their mean
    np.testing.assert_allclose(total[[2, 3, 4]], mean[[2, 3, 4]])
    assert total[1] == pytest.approx(mean[2] + mean[4])
    assert mean[1] == pytest.approx((mean[2] + mean[4]) / 2)
    with pytest.raises(ValueError, match="advantage.shared_prefix"):
        TreeGRPO(shared_prefix="max")


def test_tree_grpo_branch_weight_splits_the_prompt_term_of_a_prefix_between_its_samples():
    split, other = node_advantages(two_trees(), TreeGRPO(branch_weight=True))
    # tree 0, leaves b (1), d (0), c (0; a continuation from a): prompt term over all three, mean 1/3,
    # std sqrt(1/3): b +1.1547, d and c -0.5774; subtree {b, c}: +-0.7071, {d} alone 0. b and c are the
    # two samples of a's next turn, so their prompt terms count half; a and d (first turns) count whole
    g, h = (2 / 3) / (np.sqrt(1 / 3) + 1e-6), (1 / 3) / (np.sqrt(1 / 3) + 1e-6)
    loc = 1 / np.sqrt(2)
    np.testing.assert_allclose(split, [0, (g - h) / 2, loc + g / 2, -h, -loc - h / 2], rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(other, [0, 0])  # one leaf: no contrast
    bounded, _ = node_advantages(two_trees(), TreeGRPO(bounded=True, branch_weight=True))
    # bounded: prompt term from the bare pair b, d (+-0.7071), subtree term centred (+-0.5)
    np.testing.assert_allclose(bounded[[2, 3, 4]], [0.5 + loc / 2, -loc, -0.5 - loc / 2], rtol=1e-5)


def test_tree_grpo_bounded_reads_which_leaves_are_bare():
    a0, a1 = node_advantages(two_trees(), TreeGRPO(bounded=True))
    # tree 0: bare leaves b (1) and d (0): prompt term +-0.7071 for all three leaves (c, a continuation,
    # is measured against the bare pair's mean 0.5); subtree {b, c} = {1, 0} centred +-0.5, {d} alone 0
    h = np.sqrt(0.5)
    np.testing.assert_allclose(a0[[2, 3, 4]], [h + 0.5, -h, -h - 0.5], rtol=1e-5)
    assert a0[1] == pytest.approx((a0[2] + a0[4]) / 2)  # the shared prefix: the mean of its leaves
    assert a1.tolist() == [0.0, 0.0]


def test_tree_segment_uses_backed_up_values():
    a0, _ = node_advantages(two_trees(), TreeSegment())
    # V̂: root 1/3, a 1/2, b 1, d 0, c 0. A(b) = (1 - 1/2) + (1 - 1/3) = 7/6
    assert a0[2] == pytest.approx(7 / 6)
    assert a0[1] == pytest.approx((0.5 - 1 / 3) * 2)
    assert a0[0] == 0.0


def test_each_action_token_is_trained_exactly_once_and_observations_never():
    trees = two_trees()
    seqs = leaf_sequences(trees, node_advantages(trees, TreeSegment()))
    assert [(s.tree_index, s.leaf) for s in seqs] == [(0, 2), (0, 3), (0, 4), (1, 1)]
    b, d, c = seqs[0], seqs[1], seqs[2]
    assert b.token_ids == [100, 101, 1, 2, 3, 4]
    assert b.loss_mask == [0, 0, 1, 1, 0, 1]  # prompt and observation masked; a owned by leaf b
    assert c.token_ids == [100, 101, 1, 2, 3, 8, 9]
    assert c.loss_mask == [0, 0, 0, 0, 0, 1, 1]  # a is context only here: trained once, in b
    assert d.loss_mask == [0, 0, 1]
    trained = sum(sum(s.loss_mask) for s in seqs)
    assert trained == sum(len(n.action_ids) for t in trees for n in t.nodes)


def test_predictor_targets_read_at_prefix_ends_once():
    trees = two_trees()
    seqs = leaf_sequences(trees, node_advantages(trees, GRPO()))
    b = seqs[0]
    # root target at the last prompt token (1), prefix a at the end of its observation (4)
    assert b.pred_positions == [1, 4]
    assert b.pred_targets == pytest.approx([1 / 3, 0.5])
    assert b.pred_weights == [3.0, 2.0]
    assert sum(len(s.pred_positions) for s in seqs) == 3  # root 0, a, root 1: each once


def test_collate_pads_right_and_keeps_targets_aligned():
    trees = two_trees()
    seqs = leaf_sequences(trees, node_advantages(trees, GRPO()))
    batch = collate(seqs, pad_id=0)
    assert batch.input_ids.shape == (4, 7)
    assert batch.attention_mask.sum().item() == sum(len(s.token_ids) for s in seqs)
    assert batch.input_ids[batch.pred_rows, batch.pred_cols].tolist() == [101, 3, 102]
    assert torch.all(batch.advantages[batch.loss_mask == 0] == 0)


def many_trees(n: int = 5) -> list[RolloutTree]:
    """n trees of 1, 2, ... leaves (7 in all for n = 3), rewards alternating."""
    trees = []
    for i in range(n):
        t = RolloutTree(task_id=i, prompt_ids=[100 + i])
        for j in range(i + 1):
            t.finish(t.add_turn(0, "bare", [1 + j], []), float(j % 2), "answer")
        trees.append(t)
    return trees


@pytest.mark.parametrize("tokens", [None, 4])
def test_fixed_steps_split_the_leaves_evenly_whatever_the_micro_batching(tokens):
    trees = many_trees(5)  # 1 + 2 + 3 + 4 + 5 = 15 leaves
    key = lambda s: (s.tree_index, s.leaf)  # noqa: E731
    every = [key(s) for s in leaf_sequences(trees, node_advantages(trees, GRPO()))]
    for steps in (1, 2, 4, 15):
        plan = Batching(micro_batch_size=2, micro_batch_tokens=tokens, estimator=GRPO(), steps=steps).plan(
            trees
        )
        assert len(plan) == steps
        counts = [sum(len(chunk) for chunk in step) for step in plan]
        assert sum(counts) == 15 and max(counts) - min(counts) <= 1  # 15 / 4: 4, 4, 4, 3 in some order
        # every leaf once, in tree order
        assert sorted(key(s) for step in plan for chunk in step for s in chunk) == sorted(every)
    # more steps than leaves: the extra steps are empty (they train nothing)
    plan = Batching(micro_batch_size=2, micro_batch_tokens=tokens, estimator=GRPO(), steps=20).plan(trees)
    assert len(plan) == 20 and sum(1 for step in plan if not step) == 5
    # steps=None: one step per micro-batch, as many as micro-batching makes
    plan = Batching(micro_batch_size=2, micro_batch_tokens=tokens, estimator=GRPO()).plan(trees)
    assert all(len(step) == 1 for step in plan)


@pytest.mark.parametrize("tokens", [None, 4])
def test_spread_trees_deal_each_tree_across_the_steps(tokens):
    trees = many_trees(5)  # trees of 1..5 leaves, 15 in all
    key = lambda s: (s.tree_index, s.leaf)  # noqa: E731
    every = [key(s) for s in leaf_sequences(trees, node_advantages(trees, GRPO()))]
    for steps in (2, 3, 4, 15):
        batching = Batching(micro_batch_size=2, micro_batch_tokens=tokens, estimator=GRPO(), steps=steps)
        cut = batching.plan(trees)
        dealt = Batching(
            micro_batch_size=2, micro_batch_tokens=tokens, estimator=GRPO(), steps=steps, spread=True
        ).plan(trees)
        assert len(dealt) == steps
        per_step = [[key(s) for chunk in step for s in chunk] for step in dealt]
        assert sorted(k for step in per_step for k in step) == sorted(every)  # every leaf once
        # 15 leaves over the steps as evenly as they go: 15 // steps each, one more for 15 % steps of them
        assert sorted(len(step) for step in per_step) == sorted(
            15 // steps + (i < 15 % steps) for i in range(steps)
        )
        for t, tree in enumerate(trees):  # a tree of g leaves reaches min(g, steps) steps, at most
            reached = sum(1 for step in per_step if any(k[0] == t for k in step))  # one leaf per step
            assert reached == min(len(tree.leaves()), steps)
        # within a step the leaves stay in tree order, so one tree's leaves there pack together
        assert all(step == sorted(step) for step in per_step)
        # and no step holds fewer distinct prompts than the emptiest step of the cut plan
        distinct = [len({k[0] for k in step}) for step in per_step]
        assert min(distinct) >= min(len({s.tree_index for c in step for s in c}) for step in cut)
    with pytest.raises(ValueError, match="steps_per_iteration"):
        Batching(micro_batch_size=2, micro_batch_tokens=None, estimator=GRPO(), spread=True)


def test_the_step_layout_pads_each_step_to_the_same_accumulation():
    a, b, c = ([object()] for _ in range(3))  # three one-sequence micro-batches
    assert step_layout([[a, b], [c], []], per_step=2) == [a, b, c, [], [], []]
    with pytest.raises(ValueError, match="steps_per_iteration"):
        Batching(micro_batch_size=2, micro_batch_tokens=None, estimator=GRPO(), steps=0)
