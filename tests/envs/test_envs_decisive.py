"""The decisive-turn testbed (envs/decisive.py): rules, splits, the teacher, and a played episode."""

import numpy as np
import pytest

from trace_lightning.envs.decisive import (
    TEACHER_SHIFT_ACCURACY,
    DecisiveEnv,
    make_decisive_tasks,
    teacher_pick,
)


def play(env, task, picks):
    state, out = env.initial_state(task), None
    for pick in picks:
        out = env.step(task, state, f"<choose>{pick}</choose>")
        state = out.state
        if out.done:
            break
    return out


def test_task_family_is_heterogeneous_and_splits_never_share_a_task():
    train, held = DecisiveEnv(1000, 200, "train", 0), DecisiveEnv(1000, 200, "heldout", 0)
    assert len(train.tasks()) == 1000 and len(held.tasks()) == 200
    assert not {t.task_id for t in train.tasks()} & {t.task_id for t in held.tasks()}

    # nor a verbatim copy under another id: no held-out task shows and scores what a training task does
    def key(t):
        return (t.shown, t.decisive, t.shift, t.tolerance, t.n_letters)

    assert not {key(t) for t in train.decisive_tasks} & {key(t) for t in held.decisive_tasks}
    specs = train.decisive_tasks
    assert {t.turns for t in specs} == {2, 3, 4} and {t.shift for t in specs} == {0, 1, 2, 3}
    assert {t.tolerance for t in specs} == {0, 1} and {t.n_letters for t in specs} == {8, 16}
    assert 0.15 < np.mean([t.tolerance for t in specs]) < 0.25


def test_right_answers_win_and_the_decisive_answer_is_the_shifted_letter():
    env = DecisiveEnv(50, 0, "train", 1)
    for spec, task in zip(env.decisive_tasks, env.tasks(), strict=True):
        answers = [spec.answer(t) for t in range(spec.turns)]
        assert answers[spec.decisive] == chr(ord(spec.shown[spec.decisive]) + spec.shift)
        out = play(env, task, answers)
        assert out.done and out.reward == 1.0
        # copying the shown letter at a shifted decisive turn is a mistake: lost without tolerance
        copied = list(answers)
        copied[spec.decisive] = spec.shown[spec.decisive]
        out = play(env, task, copied)
        expect = 1.0 if spec.shift == 0 or spec.tolerance == 1 else 0.0
        assert out.done and out.reward == expect


def test_attributes_are_what_the_question_states():
    env = DecisiveEnv(40, 0, "train", 3)
    for task in env.tasks():
        # "3 keys, 0 errors ok, A-H. Key 2 +2. Key 1: C." -> errors_ok=0, shift=2, keys=3, read off the text
        keys, errors = task.question.split(" keys, ")[0], task.question.split(", ")[1].split(" errors")[0]
        shift = task.question.split(" +")[1].split(".")[0]
        assert env.attributes(task) == (f"errors_ok={errors}", f"shift={shift}", f"keys={keys}")


def test_the_question_and_observations_show_the_cues():
    env = DecisiveEnv(30, 0, "train", 2)
    spec, task = next((s, t) for s, t in zip(env.decisive_tasks, env.tasks(), strict=True) if s.decisive == 1)
    assert f"Key 2 +{spec.shift}." in task.question and task.question.endswith(f"Key 1: {spec.shown[0]}.")
    out = env.step(task, env.initial_state(task), f"<choose>{spec.shown[0]}</choose>")
    assert (
        out.observation
        == f"<observation>ok. Key 2: {spec.shown[1]}+{spec.shift}={spec.answer(1)}.</observation>"
    )


def test_a_letter_outside_the_task_is_a_format_error():
    env = DecisiveEnv(30, 0, "train", 3)
    _, task = next((s, t) for s, t in zip(env.decisive_tasks, env.tasks(), strict=True) if s.n_letters == 8)
    out = env.step(task, (0, 0), "<choose>Z</choose>")
    assert out.format_error and not out.done and out.state == (0, 0)


def test_teacher_applies_the_shift_with_its_accuracy():
    rng = np.random.default_rng(0)
    assert teacher_pick("C", rng) == "C"
    for k, acc in enumerate(TEACHER_SHIFT_ACCURACY):
        picks = [teacher_pick(f"C+{k}={chr(ord('C') + k)}", rng) for _ in range(4000)]
        assert np.mean([p == chr(ord("C") + k) for p in picks]) == pytest.approx(acc if k else 1.0, abs=0.03)


def test_bad_arguments_name_their_key():
    with pytest.raises(ValueError, match="env.split"):
        DecisiveEnv(10, 2, "test")
    assert len(make_decisive_tasks(5, seed=0, first_id=100)) == 5
