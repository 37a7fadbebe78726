"""Advantage estimators: peer goldens (verl 0.9.1, /work/shared/DATA.md), hand-derived tree examples,
and vectorised == plain-loop reference on random groups and random trees."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from trace_lightning.advantages import (
    branch_weights,
    dr_grpo,
    dr_grpo_reference,
    grpo,
    grpo_reference,
    node_advantages_from_leaves,
    node_advantages_from_leaves_reference,
    rloo,
    rloo_reference,
    tree_grpo,
    tree_grpo_bounded,
    tree_grpo_bounded_reference,
    tree_grpo_reference,
    tree_segment,
    tree_segment_reference,
)


def _t(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


ONE_GROUP = torch.zeros(4, dtype=torch.long)


# ------------------------------------------------------------------ leaf-level goldens (verl 0.9.1)


@pytest.mark.parametrize(
    ("rewards", "expected"),
    [
        ([1, 0, 0, 1], [0.866024, -0.866024, -0.866024, 0.866024]),
        ([0, 0, 0, 1], [-0.499999, -0.499999, -0.499999, 1.499997]),
    ],
)
def test_grpo_matches_verl(rewards: list[float], expected: list[float]) -> None:
    torch.testing.assert_close(grpo(_t(rewards), ONE_GROUP), _t(expected), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("fn", "expected_1001", "expected_0001"),
    [
        (dr_grpo, [0.5, -0.5, -0.5, 0.5], [-0.25, -0.25, -0.25, 0.75]),
        (rloo, [2 / 3, -2 / 3, -2 / 3, 2 / 3], [-1 / 3, -1 / 3, -1 / 3, 1.0]),
    ],
)
def test_dr_grpo_and_rloo_match_verl(fn, expected_1001: list[float], expected_0001: list[float]) -> None:
    torch.testing.assert_close(fn(_t([1, 0, 0, 1]), ONE_GROUP), _t(expected_1001), atol=1e-6, rtol=0)
    torch.testing.assert_close(fn(_t([0, 0, 0, 1]), ONE_GROUP), _t(expected_0001), atol=1e-6, rtol=0)


@pytest.mark.parametrize("fn", [grpo, dr_grpo, rloo])
def test_degenerate_groups_are_exactly_zero(fn) -> None:
    # Group 7: all equal (0.1 is not exact in binary, so a float mean could miss it by an ulp);
    # group 3: a single leaf; group 5: the only group with contrast.
    rewards = _t([0.1, 0.1, 0.1, 0.9, 1.0, 0.0])
    groups = torch.tensor([7, 7, 7, 3, 5, 5])
    adv = fn(rewards, groups)
    assert torch.isfinite(adv).all()
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[4] > 0 > adv[5]


def test_grpo_all_equal_group_is_exactly_zero() -> None:
    assert grpo(_t([1, 1, 1, 1]), ONE_GROUP).tolist() == [0.0] * 4


def test_groups_are_labels_not_positions() -> None:
    # Two interleaved groups with arbitrary labels give the same advantages as each group alone.
    rewards = _t([1, 5, 0, 7, 0, 5, 1, 6])
    groups = torch.tensor([42, -3, 42, -3, 42, -3, 42, -3])
    adv = grpo(rewards, groups)
    torch.testing.assert_close(adv[0::2], grpo(rewards[0::2], ONE_GROUP))
    torch.testing.assert_close(adv[1::2], grpo(rewards[1::2], ONE_GROUP))


def test_tree_grpo_worked_example() -> None:
    # Local groups {1, 0} and {1, 1}: local GRPO [+0.707, -0.707, 0, 0] (std of {1, 0} is sqrt(1/2)).
    # Global group {1, 0, 1, 1}: mean 0.75, unbiased std 0.5 -> [+0.5, -1.5, +0.5, +0.5].
    rewards = _t([1, 0, 1, 1])
    adv = tree_grpo(rewards, torch.tensor([0, 0, 1, 1]), ONE_GROUP)
    half_sqrt2 = math.sqrt(0.5)
    torch.testing.assert_close(adv, _t([half_sqrt2 + 0.5, -half_sqrt2 - 1.5, 0.5, 0.5]), atol=1e-5, rtol=0)


def test_tree_grpo_bounded_worked_examples() -> None:
    # Bare [1, 0] (mean 0.5, unbiased std sqrt(1/2)) plus a continuation (0) of the first bare rollout:
    # prompt term +-0.7071 from the bare pair; subtree {leaf 0, leaf 2} = {1, 0} centred: +0.5, -0.5.
    bare = torch.tensor([True, True, False])
    adv = tree_grpo_bounded(_t([1, 0, 0]), torch.tensor([0, 1, 0]), torch.zeros(3, dtype=torch.long), bare)
    h = math.sqrt(0.5)
    torch.testing.assert_close(adv, _t([h + 0.5, -h, -h - 0.5]), atol=1e-5, rtol=0)
    # A rare flip among near-copies: bare [1, 1] (no contrast: no prompt term) and continuations [1, 1, 0]
    # of the first; subtree {1, 1, 1, 0} has mean 0.75. Plain tree_grpo gives the flip about -3.29.
    bare = torch.tensor([True, True, False, False, False])
    local, one = torch.tensor([0, 1, 0, 0, 0]), torch.zeros(5, dtype=torch.long)
    adv = tree_grpo_bounded(_t([1, 1, 1, 1, 0]), local, one, bare)
    torch.testing.assert_close(adv, _t([0.25, 0.0, 0.25, 0.25, -0.75]), atol=1e-6, rtol=0)
    assert tree_grpo(_t([1, 1, 1, 1, 0]), local, one)[4] < -3.2


def test_tree_grpo_bounded_without_continuations_is_grpo() -> None:
    rewards, groups = _t([1, 0, 0, 1, 1, 1, 0, 1]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    local = torch.arange(8)  # every bare rollout is its own subtree: no continuation anywhere
    adv = tree_grpo_bounded(rewards, local, groups, torch.ones(8, dtype=torch.bool))
    torch.testing.assert_close(adv, grpo(rewards, groups), atol=1e-6, rtol=0)


def test_empty_input() -> None:
    empty = torch.zeros(0)
    groups = torch.zeros(0, dtype=torch.long)
    for fn in (grpo, dr_grpo, rloo):
        assert fn(empty, groups).shape == (0,)


group_cases = st.lists(
    st.tuples(st.integers(0, 9), st.sampled_from([0.0, 0.25, 0.5, 1.0]) | st.floats(-5, 5)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=50, deadline=None)
@given(group_cases, st.integers(0, 4))
# bare rewards that differ by 1e-180: their squares underflow, and the prompt term must still see contrast
@example([(0, 0.0), (0, 0.25), (0, 0.0), (0, 0.0), (0, 0.0), (0, 2.6751781204796926e-180)], 2)
def test_leaf_estimators_match_reference(cases: list[tuple[int, float]], n_local: int) -> None:
    groups = torch.tensor([g for g, _ in cases])
    rewards = torch.tensor([r for _, r in cases], dtype=torch.float64)
    for fn, ref in ((grpo, grpo_reference), (dr_grpo, dr_grpo_reference), (rloo, rloo_reference)):
        torch.testing.assert_close(fn(rewards, groups), ref(rewards, groups), atol=1e-9, rtol=1e-9)
    local = groups % (n_local + 1)  # coarser labels stand in for a second grouping
    torch.testing.assert_close(
        tree_grpo(rewards, groups, local), tree_grpo_reference(rewards, groups, local), atol=1e-9, rtol=1e-9
    )
    bare = (
        torch.arange(len(cases)) * 7 + n_local
    ) % 3 > 0  # an arbitrary mix of bare leaves and continuations
    torch.testing.assert_close(
        tree_grpo_bounded(rewards, local, groups, bare),
        tree_grpo_bounded_reference(rewards, local, groups, bare),
        atol=1e-9,
        rtol=1e-9,
    )


# ------------------------------------------------------------------ tree-level estimators


def _hand_forest() -> dict[str, torch.Tensor]:
    """Two trees in one array.

    Tree A (nodes 0-4): 0 -> 1 -> {2: r=1, 3: r=0};  0 -> 4: r=1.
        V̂ = [2/3, 1/2, 1, 0, 1], leaf counts [3, 2, 1, 1, 1].
    Tree B (nodes 5-7): 5 -> 6: r=0;  5 -> 7 (unfinished turn, no leaf: V̂ NaN).
        V̂ = [0, 0, NaN], leaf counts [1, 1, 0].
    """
    return {
        "values": torch.tensor([2 / 3, 0.5, 1.0, 0.0, 1.0, 0.0, 0.0, math.nan], dtype=torch.float64),
        "parents": torch.tensor([-1, 0, 1, 1, 0, -1, 5, 5]),
        "roots": torch.tensor([0, 0, 0, 0, 0, 5, 5, 5]),
        "leaf_counts": torch.tensor([3, 2, 1, 1, 1, 1, 1, 0]),
    }


def test_tree_segment_hand_example() -> None:
    # A(s) = [V(s) - V(parent)] + [V(s) - V(root)]:
    #   node 1: (1/2 - 2/3) + (1/2 - 2/3) = -1/3
    #   node 2: (1 - 1/2) + (1 - 2/3)     = +5/6
    #   node 3: (0 - 1/2) + (0 - 2/3)     = -7/6
    #   node 4: (1 - 2/3) + (1 - 2/3)     = +2/3   (parent is the root: both terms agree)
    #   node 6: (0 - 0) + (0 - 0)         = 0;  roots 0 and 5 -> 0;  node 7 has no leaf -> 0, not NaN.
    forest = _hand_forest()
    expected = torch.tensor([0, -1 / 3, 5 / 6, -7 / 6, 2 / 3, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(tree_segment(**forest), expected)
    # Scaled by 1 / sqrt(leaf count): only node 1 (2 leaves) changes.
    expected[1] = -1 / 3 / math.sqrt(2)
    torch.testing.assert_close(tree_segment(**forest, scale_by_leaves=True), expected)


def test_node_advantages_hand_example() -> None:
    # Tree A of `_hand_forest` with leaf advantages 2: +1, 3: -0.5, 4: +0.25.
    #   node 1 = mean(+1, -0.5) = 0.25;  root 0 = mean(+1, -0.5, +0.25) = 0.25;  leaves keep their own.
    # Tree B: leaf 6 has advantage -2, so root 5 = -2; node 7 has no leaf below -> 0.
    parents = _hand_forest()["parents"]
    leaf_index = torch.tensor([2, 3, 4, 6])
    leaf_adv = torch.tensor([1.0, -0.5, 0.25, -2.0])
    expected = torch.tensor([0.25, 0.25, 1.0, -0.5, 0.25, -2.0, -2.0, 0.0])
    torch.testing.assert_close(node_advantages_from_leaves(parents, leaf_index, leaf_adv), expected)


def test_node_advantages_rejects_bad_order() -> None:
    with pytest.raises(ValueError, match=r"parents\[i\] < i"):
        node_advantages_from_leaves(torch.tensor([-1, 2, 0]), torch.tensor([1]), torch.tensor([1.0]))


@st.composite
def forests(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """Random forest with parents[i] < i, several roots, random leaf rewards, some leafless nodes."""
    n = draw(st.integers(1, 30))
    parents = [-1] + [draw(st.integers(-1, i - 1)) if draw(st.booleans()) else i - 1 for i in range(1, n)]
    childless = [i for i in range(n) if i not in parents and parents[i] >= 0]
    leaves = [i for i in childless if draw(st.integers(0, 4)) > 0]  # ~1 in 5 childless turns unfinished
    rewards = {i: draw(st.sampled_from([0.0, 1.0]) | st.floats(-1, 1)) for i in leaves}
    roots, sums, counts = list(range(n)), [0.0] * n, [0] * n
    for i in range(n):
        roots[i] = i if parents[i] < 0 else roots[parents[i]]
    for leaf, r in rewards.items():
        node = leaf
        while node >= 0:
            sums[node], counts[node] = sums[node] + r, counts[node] + 1
            node = parents[node]
    return {
        "values": torch.tensor(
            [s / c if c else math.nan for s, c in zip(sums, counts, strict=True)], dtype=torch.float64
        ),
        "parents": torch.tensor(parents),
        "roots": torch.tensor(roots),
        "leaf_counts": torch.tensor(counts),
        "leaf_index": torch.tensor(leaves, dtype=torch.long),
        "leaf_adv": torch.tensor([rewards[i] - 0.5 for i in leaves], dtype=torch.float64),
    }


@settings(max_examples=50, deadline=None)
@given(forests(), st.booleans())
def test_tree_estimators_match_reference(forest: dict[str, torch.Tensor], scale: bool) -> None:
    seg_args = (forest["values"], forest["parents"], forest["roots"], forest["leaf_counts"], scale)
    seg = tree_segment(*seg_args)
    assert torch.isfinite(seg).all()
    torch.testing.assert_close(seg, tree_segment_reference(*seg_args), atol=1e-12, rtol=1e-12)
    node_args = (forest["parents"], forest["leaf_index"], forest["leaf_adv"])
    node_adv = node_advantages_from_leaves(*node_args)
    torch.testing.assert_close(node_adv, node_advantages_from_leaves_reference(*node_args))
    # A leaf's node advantage is its own advantage: the rule only averages where leaves share a node.
    torch.testing.assert_close(node_adv[forest["leaf_index"]], forest["leaf_adv"])


def test_branch_weights_hand_example() -> None:
    # root 0 -> 1; 1 -> 2 (bare), 3, 4 (continuations); 2 -> 5 (bare), 6; a second root 7 -> 8
    w = branch_weights([-1, 0, 1, 1, 1, 2, 2, -1, 7])
    assert w.tolist() == pytest.approx([1, 1, 1 / 3, 1 / 3, 1 / 3, 1 / 6, 1 / 6, 1, 1])


@settings(max_examples=50, deadline=None)
@given(forests())
def test_branch_weights_are_products_of_shares(forest: dict[str, torch.Tensor]) -> None:
    """From the definition: a first turn weighs 1; every step down from a turn prefix divides by the
    number of turns sampled from it. So the children of any turn prefix sum to its weight."""
    parents = forest["parents"].tolist()
    w = branch_weights(forest["parents"].numpy())
    for node, parent in enumerate(parents):
        expected = 1.0
        while parent >= 0 and parents[parent] >= 0:  # the step down from a turn prefix, not from a root
            expected /= parents.count(parent)
            parent = parents[parent]
        assert w[node] == pytest.approx(expected)
    for prefix in {p for p in parents if p >= 0 and parents[p] >= 0}:
        kids = [i for i, p in enumerate(parents) if p == prefix]
        assert sum(w[k] for k in kids) == pytest.approx(w[prefix])
