import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_lightning.tree import RolloutTree, backup, predictor_targets, tree_stats


def small_tree() -> RolloutTree:
    """root -> a -> b (leaf, 1)            two bare rollouts, one continuation from `a`
    |    -> c (leaf, 0)   [expand]
    -> d (leaf, 0)
    """
    t = RolloutTree(task_id=7, prompt_ids=[100, 101])
    a = t.add_turn(0, "bare", [1, 2], [3])
    b = t.add_turn(a, "bare", [4], [])
    t.finish(b, 1.0, "answer")
    d = t.add_turn(0, "bare", [5], [6, 6])
    t.finish(d, 0.0, "answer")
    c = t.add_turn(a, "expand", [8, 9], [])
    t.finish(c, 0.0, "answer")
    return t


def random_tree(rng: np.random.Generator, n_turns: int) -> RolloutTree:
    """Grow random chains from random non-leaf nodes; every chain ends in a leaf."""
    t = RolloutTree(task_id=0)
    for _ in range(n_turns):
        open_nodes = [n.id for n in t.nodes if n.reward is None]
        node = t.add_turn(int(rng.choice(open_nodes)), "bare", [int(rng.integers(50))], [])
        if rng.random() < 0.4:
            t.finish(node, float(rng.integers(2)), "answer")
    for n in list(t.nodes):  # close every open chain so all subtrees end in leaves
        if n.id and n.reward is None and not n.children:
            t.finish(n.id, float(rng.integers(2)), "answer")
    return t


def test_backup_by_hand():
    b = backup(small_tree())
    # node a has leaves b (1) and c (0): V̂ = 0.5, mixed; root has 1,0,0 -> 1/3, mixed
    assert b.leaves.tolist() == [3, 2, 1, 1, 1]
    np.testing.assert_allclose(b.value, [1 / 3, 0.5, 1.0, 0.0, 0.0])
    assert b.mixed.tolist() == [True, True, False, False, False]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 40))
def test_backup_equals_subtree_leaf_mean(seed, n):
    t = random_tree(np.random.default_rng(seed), n)
    b = backup(t)
    for node in t.nodes:
        below = [leaf for leaf in t.leaves() if node.id == leaf or node.id in [0, *t.path(leaf)]]
        rewards = [t.nodes[leaf].reward for leaf in below]
        assert b.leaves[node.id] == len(below)
        if below:
            assert b.value[node.id] == pytest.approx(np.mean(rewards))
            assert b.mixed[node.id] == (0 < sum(r >= 0.5 for r in rewards) < len(rewards))


def test_token_ids_and_owner_leaf():
    t = small_tree()
    assert t.token_ids(2) == [100, 101, 1, 2, 3, 4]
    assert t.token_ids(4) == [100, 101, 1, 2, 3, 8, 9]
    # node a (1) is trained once, in the sequence of its lowest-id leaf (2)
    assert t.owner_leaf().tolist() == [2, 2, 2, 3, 4]


def test_stats_and_contrastive_pairs():
    s = tree_stats(small_tree())
    assert (s.leaves, s.nodes, s.depth, s.mixed) == (3, 5, 2, True)
    assert s.mixed_by_depth == [1, 1, 0]
    assert s.leaves_by_stage == {"bare": 2, "expand": 1}
    # opposite-outcome leaf pairs: (b, c) anchored at a (a prefix), (b, d) anchored at the root
    assert (s.contrastive_pairs, s.prefix_contrastive_pairs) == (2, 1)
    assert s.branching == pytest.approx(2.0)


def test_predictor_targets_cover_internal_nodes_with_leaf_counts():
    tg = predictor_targets(small_tree())
    assert tg.node_ids.tolist() == [0, 1]
    np.testing.assert_allclose(tg.values, [1 / 3, 0.5])
    assert tg.leaf_counts.tolist() == [3, 2]


def test_json_round_trip():
    t = small_tree()
    t.nodes[1].predicted = 0.25
    back = RolloutTree.from_json(t.to_json())
    assert back == t
    assert backup(back).value.tolist() == backup(t).value.tolist()


def test_structural_errors_are_clear():
    t = small_tree()
    with pytest.raises(ValueError, match="terminal leaf"):
        t.add_turn(2, "expand", [1], [])
    with pytest.raises(ValueError, match="has children"):
        t.finish(1, 1.0, "answer")
    with pytest.raises(ValueError, match="prompt itself"):
        RolloutTree(0).finish(0, 1.0, "answer")
    with pytest.raises(IndexError, match="not a node"):
        t.add_turn(99, "bare", [], [])
