import re

import pytest

from trace_lightning.envs.chain import ChainEnv
from trace_lightning.envs.synthetic import true_value


def play(env, task, picks):
    """Step through `picks`; return the transitions and the episode's full text."""
    state, text, transitions = env.initial_state(task), task.question, []
    for pick in picks:
        tr = env.step(task, state, f"<choose>{pick}</choose>")
        transitions.append(tr)
        text += f"<choose>{pick}</choose>" + tr.observation
        state = tr.state
        if tr.done:
            break
    return transitions, text


def wrong(env, letter):
    return env.letters[(env.letters.index(letter) + 1) % env.n_choices]


def test_question_shows_the_table_and_the_first_key():
    env = ChainEnv(n_tasks=20, seed=1)
    for task, chain in zip(env.tasks(), env.chain_tasks, strict=True):
        table = dict(re.findall(r"(\d)=([A-D])", task.question))
        assert table == {str(t + 1): task.answer[t] for t in range(chain.turns)}
        assert task.answer == tuple("ABCD"[a] for a in chain.answers)
        assert f"{chain.tolerance} mistake" in task.question and task.question.endswith("Key 1?")
    assert len({t.question.split(".")[0] for t in env.tasks()}) > 15  # tables differ
    assert [t.question for t in ChainEnv(n_tasks=20, seed=1).tasks()] == [t.question for t in env.tasks()]


def test_right_choices_win_in_short_text():
    env = ChainEnv(n_tasks=8, seed=0)
    for task in env.tasks():
        transitions, text = play(env, task, task.answer)
        assert [tr.done for tr in transitions] == [False, False, False, True]
        assert transitions[0].observation == "<observation>right. Key 2?</observation>"
        assert (transitions[-1].reward, transitions[-1].stop_reason, transitions[-1].state) == (
            1.0,
            "solved",
            (4, 0),
        )
        assert len(text) + len(env.system_prompt) < 320  # a whole 4-turn episode, prompt included


@pytest.mark.parametrize("tolerance", [0, 1])
def test_tolerance_is_respected(tolerance):
    env = ChainEnv(n_tasks=30, seed=2)
    task = next(t for t, c in zip(env.tasks(), env.chain_tasks, strict=True) if c.tolerance == tolerance)
    one_miss = [wrong(env, task.answer[0]), *task.answer[1:]]
    transitions, _ = play(env, task, one_miss)
    if tolerance == 1:  # one miss is allowed: told so, then won
        assert transitions[0].observation == "<observation>wrong. Key 2?</observation>"
        assert [tr.reward for tr in transitions] == [None, None, None, 1.0]
    else:  # lost at once
        assert [(tr.reward, tr.stop_reason) for tr in transitions] == [(0.0, "lost")]
    two_misses = [wrong(env, a) for a in task.answer[:2]] + list(task.answer[2:])
    transitions, _ = play(env, task, two_misses)
    assert (transitions[-1].reward, transitions[-1].stop_reason) == (0.0, "lost")
    assert transitions[-1].state == (tolerance + 1, tolerance + 1)


def test_state_is_immutable_and_re_enterable():
    env = ChainEnv(n_tasks=3, seed=0)
    task = env.tasks()[0]
    state = env.step(task, env.initial_state(task), f"<choose>{task.answer[0]}</choose>").state
    assert isinstance(state, tuple)
    for pick in ("A", "B", "C", "D"):
        first = env.step(task, state, f"<choose>{pick}</choose>")
        second = env.step(task, state, f"<choose>{pick}</choose>")
        assert first == second and state == (1, 0)
    # the env's state is synthetic.py's, so the exact V of any prefix is available
    assert 0.0 <= true_value(env.chain_tasks[0], *state) <= 1.0


@pytest.mark.parametrize("text", ["<choose>Z</choose>", "<choose>AB</choose>", "B", "<choose></choose>"])
def test_bad_picks_are_format_errors(text):
    env = ChainEnv(n_tasks=1)
    tr = env.step(env.tasks()[0], (1, 0), text)
    assert tr.format_error and not tr.done and tr.state == (1, 0)
    assert tr.observation.startswith("<observation>error: ")


def test_lowercase_pick_and_validation():
    env = ChainEnv(n_tasks=1)
    task = env.tasks()[0]
    assert env.step(task, (0, 0), f"<choose>{task.answer[0].lower()}</choose>").state == (1, 0)
    with pytest.raises(ValueError, match="env.n_choices"):
        ChainEnv(n_choices=1)
