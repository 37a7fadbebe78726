import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_lightning import allocation as alloc
from trace_lightning.budget import Budget, BudgetLedger
from trace_lightning.envs.synthetic import make_tasks, true_value
from trace_lightning.iteration import Shard, balance, build_trees, prefix_candidates
from trace_lightning.simulator import ChainSimulator, oracle_scores, state_of
from trace_lightning.tree import RolloutTree, backup, tree_stats

TASKS = {t.task_id: t for t in make_tasks(300, turns=4, seed=1)}


def oracle(trees, nodes):
    return oracle_scores(TASKS, trees, nodes)


def run(allocator, leaves=48, pool=64, seed=0, max_tokens=None):
    rng = np.random.default_rng(seed)
    trees = [RolloutTree(int(i)) for i in rng.choice(len(TASKS), size=pool, replace=False)]
    return build_trees(trees, allocator, alloc.Budget(leaves, max_tokens), oracle, ChainSimulator(TASKS), rng)


@settings(max_examples=25, deadline=None)
@given(which=st.integers(0, 5), groups=st.integers(1, 4), seed=st.integers(0, 500))
def test_trees_spend_exactly_the_leaf_budget(which, groups, seed):
    allocator = [
        alloc.uniform(4),
        alloc.pcl(4),
        alloc.random_expand(2, 2),
        alloc.trace(2),
        alloc.trace_root_only(2),
        alloc.trace_prefix_only(2, 2),
    ][which]
    it = run(allocator, leaves=12 * groups, seed=seed)
    leaves = sum(len(t.leaves()) for t in it.trees)
    assert leaves == it.ledger.leaves_used == 12 * groups  # spent in full, never more
    # every prompt got m_i bare rollouts; continuations only hang under turn prefixes of its tree
    for tree, m in zip(it.trees, it.root_counts[it.root_counts > 0], strict=True):
        assert sum(n.stage == "bare" for n in tree.nodes if n.parent == 0) == m
        assert tree_stats(tree).leaves_by_stage["expand"] == m * allocator.expansion


def test_token_budget_is_never_exceeded():
    it = run(alloc.trace(2), leaves=48, max_tokens=60)
    assert it.ledger.tokens_used <= 60
    assert sum(len(n.action_ids) for t in it.trees for n in t.nodes) == it.ledger.tokens_used
    stops = [t.nodes[leaf].stop_reason for t in it.trees for leaf in t.leaves()]
    assert "token_budget" in stops and len(stops) == 48


def test_continuations_restart_from_the_exact_prefix_state():
    it = run(alloc.trace(2), leaves=48)
    expanded = [
        (t, n) for t in it.trees for n in t.nodes if n.stage == "expand" and t.nodes[n.parent].stage == "bare"
    ]
    assert expanded
    for tree, node in expanded:
        parent_turn, _ = state_of(tree, node.parent)
        assert node.depth == parent_turn + 1  # the chain continues at the next turn of the prefix
        assert tree.token_ids(node.id)[: len(tree.token_ids(node.parent))] == tree.token_ids(node.parent)


def test_prefix_predictions_recorded_for_candidates():
    it = run(alloc.trace(2), leaves=48)
    for tree in it.trees:
        assert tree.root.predicted is not None
        for n in tree.nodes:
            if n.stage == "bare" and n.reward is None:
                assert n.predicted == pytest.approx(true_value(TASKS[tree.task_id], *state_of(tree, n.id)))


def test_prefix_candidates_are_non_leaf_turns():
    it = run(alloc.uniform(4), leaves=16)
    for tree in it.trees:
        cands = prefix_candidates(tree)
        assert all(tree.nodes[c].depth >= 1 and tree.nodes[c].reward is None for c in cands)


def test_oracle_value_matches_monte_carlo():
    task = TASKS[5]
    rng = np.random.default_rng(0)
    sim = ChainSimulator({5: task})
    tree = RolloutTree(5)
    ledger = BudgetLedger(Budget(4000))
    from trace_lightning.iteration import Branch

    sim([Branch(tree, 0, 4000, "bare")], ledger, rng)
    rate = backup(tree).value[0]
    assert rate == pytest.approx(true_value(task, 0, 0), abs=0.03)  # 4000 samples: 3 sigma < 0.025


def test_prompt_without_turn_prefixes_branches_from_the_prompt():
    # tolerance 0 and a first turn that is always wrong: every bare rollout ends after one turn
    from trace_lightning.envs.synthetic import ChainTask

    hopeless = {0: ChainTask(0, (0.0,), (1, 2), (0.0, 0.5), tolerance=0)}
    rng = np.random.default_rng(0)
    it = build_trees(
        [RolloutTree(0)],
        alloc.trace(2),
        alloc.Budget(6),
        lambda trees, nodes: oracle_scores(hopeless, trees, nodes),
        ChainSimulator(hopeless),
        rng,
    )
    (tree,) = it.trees
    assert it.ledger.leaves == {"bare": 2, "expand": 4}
    assert sum(n.stage == "expand" for n in tree.nodes if n.parent == 0) == 4


@settings(max_examples=30, deadline=None)
@given(counts=st.lists(st.integers(0, 8), min_size=1, max_size=20), world=st.integers(1, 4))
def test_balance_gives_every_active_prompt_one_owner_and_evens_the_load(counts, world):
    counts = np.array(counts)
    owner = balance(counts, world)
    assert ((owner >= 0) == (counts > 0)).all() and owner.max(initial=-1) < world
    load = np.bincount(owner[owner >= 0], weights=counts[owner >= 0], minlength=world)
    assert load.max() - load.min() <= counts.max()  # greedy: within one group of each other


@pytest.mark.parametrize("world", [2, 3])
def test_shards_split_one_global_allocation(world):
    """Every process allocates the same pool with the same scores; together they roll out exactly the
    single allocation, each prompt by one process, and the leaf budget holds over all of them."""
    allocator, budget, pool_ids = alloc.trace(2), alloc.Budget(48), list(range(40))
    scores = np.concatenate(oracle([RolloutTree(i) for i in pool_ids], [[0]] * len(pool_ids)))
    parts = []
    for rank in range(world):
        shard = Shard(scores, rank, world, np.random.default_rng([5, rank]))
        trees = [RolloutTree(i) for i in pool_ids]
        parts.append(
            build_trees(
                trees, allocator, budget, oracle, ChainSimulator(TASKS), np.random.default_rng(0), shard
            )
        )
    counts = parts[0].root_counts
    assert all((p.root_counts == counts).all() for p in parts)
    owned = [t.task_id for p in parts for t in p.trees]
    assert sorted(owned) == sorted(np.array(pool_ids)[counts > 0].tolist())  # each active prompt once
    assert sum(p.ledger.leaves_used for p in parts) == 48


def test_roots_record_the_prediction_they_are_given_not_stage_1s_estimates():
    """One writer for `root.predicted`: Stage 1 runs on `root_scores`, the roots record `root_predicted`."""
    rng = np.random.default_rng(0)
    pool = [RolloutTree(int(i)) for i in rng.choice(len(TASKS), size=16, replace=False)]
    estimates = np.linspace(0.05, 0.95, 16)
    it = build_trees(
        pool, alloc.trace(2), Budget(24), oracle, ChainSimulator(TASKS), rng,
        root_scores=estimates, root_predicted=np.full(16, 0.3),
    )  # fmt: skip
    assert [t.root.predicted for t in pool] == [0.3] * 16
    assert it.pool_predicted.tolist() == estimates.tolist()  # what Stage 1 allocated on
