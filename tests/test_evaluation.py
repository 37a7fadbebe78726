"""Evaluation numbers: pass@k and its standard error against values worked out by hand
from Chen et al.'s formula and the definition of a standard error, never from the code under test;
the `eval` settings' checks; hand-built trees scored."""

import itertools
import math

import pytest

from trace_lightning.engines.base import SamplingParams
from trace_lightning.evaluation import EvalResult, EvalSettings, mean_and_se, paired_change, pass_at_k, score
from trace_lightning.tree import RolloutTree

# --------------------------------------------------------------------------- pass@k of one task


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # pass@1 is c / n
        (4, 3, 1, 0.75),
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 3, 2, 1.0),  # one failure: any 2 of the 4 hold a success, C(1,2) = 0
        (10, 0, 5, 0.0),  # no success, no pass
        (10, 10, 5, 1.0),
        (8, 2, 4, 1 - 15 / 70),  # 1 - C(6,4)/C(8,4) = 1 - 15/70
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("n", "c", "k"), [(n, c, k) for n in (3, 5, 6) for c in range(n + 1) for k in (1, 2, 3)]
)
def test_pass_at_k_is_the_mean_over_all_k_subsets_of_the_episodes(n, c, k):
    """The estimator's definition (Chen et al. 2021): the share of k-subsets of the n episodes that
    contain at least one success, enumerated here subset by subset."""
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    expected = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)


# --------------------------------------------------------------------------- the standard error


def test_standard_error_by_hand():
    # [0.25, 0.75]: mean 0.5; deviations +-0.25, sample variance (0.0625 * 2) / 1 = 0.125, std 0.35355;
    # SE = 0.35355 / sqrt(2) = 0.25
    mean, se = mean_and_se([0.25, 0.75])
    assert mean == pytest.approx(0.5) and se == pytest.approx(0.25)
    # the default job's held-out start in BENCHMARKS.md (8 tasks x 4 episodes): per-task rates
    # [0.5, 0, 0.25, 0.75, 0, 0, 0, 1], mean 2.5 / 8 = 0.3125; squared deviations sum to 1.09375,
    # sample variance 1.09375 / 7 = 0.15625, SE = sqrt(0.15625 / 8) = 0.139754
    mean, se = mean_and_se([0.5, 0, 0.25, 0.75, 0, 0, 0, 1])
    assert mean == pytest.approx(0.3125) and se == pytest.approx(0.139754, abs=1e-6)
    assert math.isnan(mean_and_se([0.5])[1]) and all(math.isnan(v) for v in mean_and_se([]))


# --------------------------------------------------------------------------- scoring trees


def task_tree(task_id: int, rewards: list[float]) -> RolloutTree:
    """One task evaluated: a bare episode of one turn per reward."""
    tree = RolloutTree(task_id, [1, 2, 3])
    for r in rewards:
        tree.finish(tree.add_turn(0, "bare", [4], []), r, "answer")
    return tree


def test_score_of_hand_built_episodes():
    # task 7: 1 success in 4 (a reward of 0.4 is below tree.SUCCESS = 0.5); task 9: 3 in 4
    trees = [task_tree(7, [1.0, 0.0, 0.4, 0.0]), task_tree(9, [1.0, 0.6, 1.0, 0.0])]
    got = score(trees, k=2, temperature=0.8, seconds=3.0)
    assert (got.task_ids, got.successes, got.samples, got.episodes) == ((7, 9), (1, 3), 4, 8)
    # pass@1: 0.25 and 0.75 -> 0.5 +- 0.25 (above); pass@2: 1 - C(3,2)/C(4,2) = 0.5 and 1 -> 0.75 +- 0.25
    assert (got.pass_at_1, got.pass_at_1_se) == (pytest.approx(0.5), pytest.approx(0.25))
    assert (got.pass_at_k, got.pass_at_k_se) == (pytest.approx(0.75), pytest.approx(0.25))
    assert got.reward == pytest.approx(4.0 / 8) and got.turns == 1.0
    metrics = got.metrics()
    assert metrics["eval/pass_at_1"] == got.pass_at_1 and metrics["eval/pass_at_2_se"] == got.pass_at_k_se
    assert not any("@" in key for key in metrics)  # MLflow refuses '@' in metric keys
    with pytest.raises(ValueError, match="same number of episodes"):
        score([task_tree(1, [1.0]), task_tree(2, [1.0, 0.0])], 1, 0.8, 0.0)


def result(task_ids, successes, samples=4) -> EvalResult:
    return score(
        [task_tree(t, [1.0] * c + [0.0] * (samples - c)) for t, c in zip(task_ids, successes, strict=True)],
        1,
        1.0,
        0,
    )


def test_the_change_since_the_start_is_paired_by_task():
    before, after = result([1, 2, 3], [0, 2, 4]), result([1, 2, 3], [1, 3, 4])
    # per-task differences 0.25, 0.25, 0: mean 1/6; deviations 1/12, 1/12, -1/6 -> squares sum
    # 1/144 + 1/144 + 4/144 = 6/144, sample variance 3/144, SE = sqrt(3/144 / 3) = 1/12
    change, se = paired_change(before, after)
    assert change == pytest.approx(1 / 6) and se == pytest.approx(1 / 12)
    # the unpaired SEs of the two points are far larger: the tasks' difficulty cancels in the pairs
    assert after.pass_at_1_se > 2 * se and before.pass_at_1_se > 2 * se
    # tasks only one side evaluated are left out
    assert paired_change(result([1, 2], [0, 4]), result([2, 5], [4, 0])) == (
        0.0,
        pytest.approx(math.nan, nan_ok=True),
    )


def test_pass_at_1_by_the_tasks_coarsest_attribute():
    # tasks 1, 2 in group "steps=1" with 1 and 3 of 4: 0.25, 0.75 -> 0.5 +- 0.25 (SE by hand above);
    # task 3 in "steps=2" with 2 of 4: 0.5, one task so no SE; task 4 carries none: "none", 4 of 4
    trees = [task_tree(t, [1.0] * c + [0.0] * (4 - c)) for t, c in [(1, 1), (2, 3), (3, 2), (4, 4)]]
    got = score(trees, 1, 0.8, 0.0, groups=["steps=1", "steps=1", "steps=2", ""])
    by = got.by_group()
    assert list(by) == ["none", "steps=1", "steps=2"]
    assert by["steps=1"] == (pytest.approx(0.5), pytest.approx(0.25), 2)
    assert by["steps=2"][0] == 0.5 and math.isnan(by["steps=2"][1]) and by["steps=2"][2] == 1
    assert by["none"][:1] == (1.0,) and by["none"][2] == 1
    metrics = got.metrics()  # MLflow keys take no '='
    assert (
        metrics["eval/pass_at_1/steps_1"] == pytest.approx(0.5) and metrics["eval/pass_at_1/steps_2"] == 0.5
    )
    assert score(trees, 1, 0.8, 0.0).by_group() == {}  # no attributes, no groups
    assert score(trees, 1, 0.8, 0.0, groups=[""] * 4).by_group() == {}
    assert not any(k.startswith("eval/pass_at_1/") for k in score(trees, 1, 0.8, 0.0).metrics())
    with pytest.raises(ValueError, match="one per task"):
        score(trees, 1, 0.8, 0.0, groups=["steps=1"])


# --------------------------------------------------------------------------- the `eval` settings


def test_eval_settings_check_themselves_naming_the_key():
    for kwargs, key in [
        ({"samples": 0}, "eval.samples"),
        ({"every_n_iterations": 0}, "eval.every_n_iterations"),
        ({"samples": 4, "k": 5}, "eval.k"),
        ({"temperature": -0.5}, "eval.temperature"),
        ({"temperature": 0.0, "samples": 4}, "eval.samples"),  # greedy repeats the same episode
        ({"tasks": "test"}, "eval.tasks"),
    ]:
        with pytest.raises(ValueError, match=key):
            EvalSettings(**kwargs)
    assert EvalSettings(samples=8).pass_k == 8 and EvalSettings(samples=8, k=2).pass_k == 2


def test_eval_sampling_keeps_everything_but_the_temperature():
    training = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, stop=("</answer>",))
    assert EvalSettings().sampling(training) is training  # null: the training temperature
    greedy = EvalSettings(samples=1, temperature=0.0).sampling(training)
    assert greedy == SamplingParams(max_new_tokens=24, temperature=0.0, top_p=0.9, stop=("</answer>",))
