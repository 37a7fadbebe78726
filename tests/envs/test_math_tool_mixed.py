"""math_tool with a mixture of difficulty levels, and the task attributes pooled statistics group by."""

from collections import Counter

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

from trace_lightning import config
from trace_lightning.envs.base import HasAttributes, Task
from trace_lightning.envs.math_tool import (
    MathToolEnv,
    generate_mixed_problems,
    generate_problems,
    generated_steps,
)


def problems(env: MathToolEnv) -> list[tuple[str, str]]:
    return [(task.question, task.answer[0]) for task in env.tasks()]


def level_counts(env: MathToolEnv) -> Counter[int]:
    """A level-d problem spells out exactly d steps."""
    return Counter(len(generated_steps(task.question)[1]) for task in env.tasks())


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_an_int_difficulty_gives_the_same_problems_as_before(difficulty):
    env = MathToolEnv(n_tasks=300, difficulty=difficulty, seed=4)
    assert problems(env) == generate_problems(300, difficulty=difficulty, seed=4)
    assert [task.task_id for task in env.tasks()] == list(range(300))


def test_a_list_splits_the_tasks_equally_remainder_to_the_first_levels():
    env = MathToolEnv(n_tasks=100, difficulty=[1, 2, 3], seed=0)
    assert level_counts(env) == {1: 34, 2: 33, 3: 33}  # 100 = 33 * 3 + 1, the extra one to level 1
    assert len({question for question, _ in problems(env)}) == 100
    assert [task.task_id for task in env.tasks()] == list(range(100))


def test_the_levels_are_interleaved_and_the_order_is_seeded():
    env = MathToolEnv(n_tasks=90, difficulty=[1, 2, 3], seed=3)
    assert problems(env) == problems(MathToolEnv(n_tasks=90, difficulty=[1, 2, 3], seed=3))
    assert problems(env) != problems(MathToolEnv(n_tasks=90, difficulty=[1, 2, 3], seed=4))
    first_third = Counter(len(generated_steps(task.question)[1]) for task in env.tasks()[:30])
    assert set(first_third) == {1, 2, 3}  # not level 1 first, then level 2, ...


def test_each_level_comes_from_its_own_generate_problems_stream():
    mixed = generate_mixed_problems(30, [2, 3], seed=5)
    for level in (2, 3):
        own = [p for p in mixed if len(generated_steps(p[0])[1]) == level]
        assert sorted(own) == sorted(generate_problems(15, level, seed=5 + 1_000_003 * level))


def test_weights_give_each_level_its_share():
    env = MathToolEnv(n_tasks=100, difficulty=[1, 2, 3], difficulty_weights=[1.0, 2.0, 1.0])
    assert level_counts(env) == {1: 25, 2: 50, 3: 25}
    # quotas 10 * [0.2, 0.3, 0.5] are whole numbers that floats may miss by 1e-16: largest remainder
    env = MathToolEnv(n_tasks=10, difficulty=[1, 2, 3], difficulty_weights=[0.2, 0.3, 0.5])
    assert level_counts(env) == {1: 2, 2: 3, 3: 5}


def test_hydra_lists_are_accepted():
    node = OmegaConf.create({"difficulty": [1, 3], "weights": [3, 1]})
    env = MathToolEnv(n_tasks=40, difficulty=node.difficulty, difficulty_weights=node.weights)
    assert level_counts(env) == {1: 30, 3: 10}


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"difficulty": []}, "env.difficulty"),
        ({"difficulty": [1, 6]}, "env.difficulty"),
        ({"difficulty": [1, 2, 1]}, "env.difficulty"),
        ({"difficulty": [1, 2.5]}, "env.difficulty"),
        ({"difficulty": 6}, "env.difficulty"),
        ({"difficulty": [1, 2], "difficulty_weights": [1.0]}, "env.difficulty_weights"),
        ({"difficulty": [1, 2], "difficulty_weights": [1.0, 0.0]}, "env.difficulty_weights"),
        ({"difficulty": [1, 2], "difficulty_weights": [1.0, -2.0]}, "env.difficulty_weights"),
        ({"difficulty": 2, "difficulty_weights": [1.0]}, "env.difficulty_weights"),
        ({"difficulty": [1, 2, 3], "n_tasks": 2}, "env.n_tasks"),
    ],
)
def test_bad_mixtures_are_refused_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        MathToolEnv(**{"n_tasks": 30, **kwargs})


def test_the_shipped_mixed_config_composes_and_instantiates(tmp_path):
    config.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config.conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"run_dir={tmp_path}", "env=math_tool_mixed", "env.n_tasks=60"])
    GlobalHydra.instance().clear()
    # everything but the levels comes from math_tool.yaml through `defaults`
    assert (
        cfg.env.difficulty == [1, 2, 3]
        and cfg.env.difficulty_weights == [1, 1, 2]
        and cfg.env.held_out == 200
    )
    env = instantiate(cfg.env)
    assert isinstance(env, MathToolEnv) and level_counts(env) == {1: 15, 2: 15, 3: 30}  # shares 1 : 1 : 2


@pytest.mark.parametrize(
    ("question", "gold", "expected"),
    [
        (
            "Tom has 12 apples. Then Tom buys 7 more. How many apples does Tom have now?",
            "19",
            ("steps=1", "hard_ops=0", "magnitude=2"),
        ),
        (
            "Mia has 40 coins. Then Mia ends up with 3 times as many. Then Mia gives away 20. "
            "Then Mia splits them into 4 equal groups and keeps one group. How many coins does Mia have now?",
            "25",  # (40 * 3 - 20) / 4
            ("steps=3", "hard_ops=2", "magnitude=2"),
        ),
        (
            "Ana has 150 books. How many books does Ana have now?",
            "150",
            ("steps=0", "hard_ops=0", "magnitude=3"),
        ),
        # GSM8K: not the generator's text at all ...
        (
            "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?",
            "72",
            (),
        ),
        # ... or beginning like it, with sentences that are not steps
        ("John has 3 boxes. Each box holds 4 pens. How many pens does John have?", "12", ()),
        # steps that do not replay to the gold
        ("Tom has 12 apples. Then Tom buys 7 more. How many apples does Tom have now?", "20", ()),
    ],
)
def test_attributes_of_hand_written_questions(question, gold, expected):
    assert MathToolEnv(n_tasks=1).attributes(Task(0, question, (gold,))) == expected


def test_every_generated_task_has_attributes_coarse_to_fine():
    env = MathToolEnv(n_tasks=90, difficulty=[1, 2, 3], seed=1)
    for task in env.tasks():
        steps, hard, magnitude = env.attributes(task)
        assert steps == f"steps={len(generated_steps(task.question)[1])}"
        assert hard.startswith("hard_ops=") and int(hard.split("=")[1]) <= len(
            generated_steps(task.question)[1]
        )
        assert magnitude == f"magnitude={len(task.answer[0])}"


def test_math_tool_has_attributes():
    assert isinstance(MathToolEnv(n_tasks=1), HasAttributes)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_the_warm_start_demonstrates_every_level(difficulty):
    env = MathToolEnv(n_tasks=200, difficulty=[1, 2, 3], seed=2)
    tasks = [task for task in env.tasks() if len(generated_steps(task.question)[1]) == difficulty]
    for task in tasks:
        demo = env.demonstration(task)
        assert demo is not None, task.question
        assert len(demo) == difficulty + 1  # one <calculate> per step, then the answer
        assert demo[-1] == f"<answer>{task.answer[0]}</answer>"
