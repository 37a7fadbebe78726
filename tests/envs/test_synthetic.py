import numpy as np
import pytest

from trace_lightning.envs.synthetic import ChainTask, make_tasks, true_value
from trace_lightning.simulator import state_of
from trace_lightning.tree import RolloutTree


def test_true_value_by_hand():
    # two coin-flip turns: no mistake allowed -> 1/4; one allowed -> 1 - 1/4 (lost only if both wrong)
    strict = ChainTask(0, (), (0, 1), (0.5, 0.5), tolerance=0)
    lenient = ChainTask(1, (), (0, 1), (0.5, 0.5), tolerance=1)
    assert true_value(strict, 0, 0) == pytest.approx(0.25)
    assert true_value(strict, 1, 0) == pytest.approx(0.5)
    assert true_value(strict, 1, 1) == 0.0  # decided: a sure loss
    assert true_value(lenient, 0, 0) == pytest.approx(0.75)
    assert true_value(lenient, 1, 0) == 1.0  # decided: a sure win
    assert true_value(lenient, 2, 1) == 1.0


def test_tasks_spread_from_hopeless_to_trivial():
    tasks = make_tasks(500, seed=3)
    v = np.array([true_value(t, 0, 0) for t in tasks])
    assert (v < 0.1).mean() > 0.1 and (v > 0.9).mean() > 0.1 and ((v > 0.3) & (v < 0.7)).mean() > 0.1


def test_make_tasks_is_seeded_and_validates():
    assert make_tasks(10, seed=1) == make_tasks(10, seed=1)
    with pytest.raises(ValueError, match="n_choices"):
        make_tasks(3, n_choices=1)


def test_state_replayed_from_observations():
    t = RolloutTree(0)
    a = t.add_turn(0, "bare", [2], [1])  # right
    b = t.add_turn(a, "bare", [3], [0])  # wrong
    assert state_of(t, 0) == (0, 0) and state_of(t, a) == (1, 0) and state_of(t, b) == (2, 1)
