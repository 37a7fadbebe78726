import contextlib
import json
import re
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_lightning.envs.math_tool import (
    CalculatorError,
    MathToolEnv,
    generate_problems,
    load_gsm8k,
    parse_gsm8k_answer,
    safe_calculate,
)
from trace_lightning.envs.scoring import numbers_match, parse_number

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("1+2", "3"),
        ("12 * 7", "84"),
        ("7/2", "3.5"),
        ("8/2", "4"),  # an integral float prints without ".0"
        ("1/3", "0.333333"),
        ("2**10", "1024"),
        ("-(3+4)*2", "-14"),
        ("7//2", "3"),
        ("7 % 3", "1"),
        ("-2**2", "-4"),  # Python precedence: -(2**2)
        ("1,234 + 1", "1235"),
        ("$5 * 3", "15"),
        ("3^2", "9"),
        ("6 × 7 ÷ 2", "21"),
        ("10**-7", "1e-07"),
        ("80000*1.5", "120000"),
    ],
)
def test_calculator_results(expr, expected):
    assert safe_calculate(expr) == expected


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os')",
        "__import__('os').system('true')",
        "2**10**10",
        "9**9**9",
        "99**100",
        "(10**15)*(10**15)",
        "1e400",
        "1" * 30,
        "1+" * 150 + "1",
        "(" * 150 + "1" + ")" * 49,
        "x",
        "abs(-1)",
        "(1).real",
        "lambda: 1",
        "[1, 2]",
        "'a' * 3",
        "True + 1",
        "1j",
        "(-8) ** 0.5",
        "1/0",
        "5 % 0",
        "0 ** -1",
        "1 if 1 else 2",
        "1 < 2",
        "",
        "\x00",
    ],
)
def test_hostile_input_is_refused_quickly(expr):
    start = time.perf_counter()
    with pytest.raises(CalculatorError):
        safe_calculate(expr)
    assert time.perf_counter() - start < 0.5


@given(st.text(max_size=300) | st.text(alphabet="0123456789+-*/%().^ e,", max_size=60))
def test_calculator_only_ever_raises_calculator_error(expr):
    # arithmetic-looking garbage reaches the evaluator (powers, huge numbers, zero divisions)
    with contextlib.suppress(CalculatorError):
        assert isinstance(safe_calculate(expr), str)


@pytest.mark.parametrize(
    ("pred", "gold", "expected"),
    [("72", "72", True), ("$1,234", "1234", True), ("50%", "50", True), ("12 + 7 = 19 apples", "19", True),
     ("18.0", "18", True), ("-3", "3", False), ("seventy-two", "72", False), ("", "72", False)],
)  # fmt: skip
def test_numbers_match(pred, gold, expected):
    assert numbers_match(pred, gold) is expected


def test_parse_number_reads_the_last_number():
    assert parse_number("it costs $1,234.50 in total") == 1234.5
    assert parse_number("K2 is 8,611 m, Everest 8,849 m") == 8849
    assert parse_number("no digits here") is None


def _replay(question: str) -> int:
    """Recompute a generated problem from its sentences (the generator's templates, by hand)."""
    value = int(re.search(r"has (\d+)", question).group(1))
    for verb, n in re.findall(r"(buys|gives away|ends up with|splits them into) (\d+)", question):
        k = int(n)
        value = {"buys": value + k, "gives away": value - k, "ends up with": value * k}.get(verb, value // k)
    return value


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_generated_problems_have_exact_integer_answers(difficulty):
    problems = generate_problems(200, difficulty=difficulty, seed=5)
    assert problems == generate_problems(200, difficulty=difficulty, seed=5)
    assert problems != generate_problems(200, difficulty=difficulty, seed=6)
    for question, gold in problems:
        assert int(gold) >= 0 and _replay(question) == int(gold)
        assert question.count("Then") == difficulty


def test_generator_validates_difficulty():
    with pytest.raises(ValueError, match="env.difficulty"):
        MathToolEnv(difficulty=6)


def test_episode_calculate_then_answer():
    env = MathToolEnv(n_tasks=4, seed=0)
    task = env.tasks()[0]
    state = env.initial_state(task)
    expr = re.sub(r"\D+", " ", task.question).split()  # the two operands of a difficulty-1 problem
    op = "+" if "buys" in task.question else "-"
    tr = env.step(task, state, f"I add them. <calculate>{expr[0]} {op} {expr[1]}</calculate>")
    assert tr.observation == f"<observation>= {task.answer[0]}</observation>"
    assert (tr.done, tr.tool, tr.tool_error, tr.state) == (False, "calculate", False, (1,))
    final = env.step(task, tr.state, f"So <answer>{task.answer[0]}</answer>")
    assert (final.done, final.reward, final.stop_reason, final.observation) == (True, 1.0, "answer", "")
    wrong = env.step(task, tr.state, f"<answer>{int(task.answer[0]) + 1}</answer>")
    assert wrong.done and wrong.reward == 0.0


def test_episode_errors_are_observations():
    env = MathToolEnv(n_tasks=1)
    task = env.tasks()[0]
    bad = env.step(task, (0,), "the answer is 5")
    assert bad.format_error and not bad.done and bad.state == (0,)
    assert bad.observation.startswith("<observation>error: no action found")
    failed = env.step(task, (0,), "<calculate>1/0</calculate>")
    assert failed.tool_error and failed.tool == "calculate" and not failed.done and failed.state == (1,)
    assert failed.observation == "<observation>error: division by zero</observation>"


def test_gsm8k_answer_parsing():
    answer = "She sold 48/2 = <<48/2=24>>24 clips in May.\nIn all 48+24 = <<48+24=72>>72 clips.\n#### 72"
    solution, gold = parse_gsm8k_answer(answer)
    assert gold == "72" and "<<" not in solution and "48/2 = 24 clips" in solution
    assert parse_gsm8k_answer("... #### 1,234")[1] == "1234"
    with pytest.raises(ValueError, match="####"):
        parse_gsm8k_answer("no final line")


def test_gsm8k_loader_and_config_errors(tmp_path):
    good = {"question": "What is 48+24?", "answer": "48+24=<<48+24=72>>72\n#### 72"}
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n")
    env = MathToolEnv(source="gsm8k", gsm8k_path=str(path), n_tasks=10)
    assert [t.answer for t in env.tasks()] == [("72",), ("72",)]
    assert env.step(env.tasks()[0], (0,), "<answer>72</answer>").reward == 1.0
    with pytest.raises(FileNotFoundError, match="env.gsm8k_path"):
        MathToolEnv(source="gsm8k", gsm8k_path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="env.gsm8k_path"):
        MathToolEnv(source="gsm8k", gsm8k_path=None)
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2"):
        MathToolEnv(source="gsm8k", gsm8k_path=str(path))
    with pytest.raises(ValueError, match="env.source"):
        MathToolEnv(source="svamp")


@pytest.mark.skipif(
    not GSM8K_TEST.is_file(), reason=f"GSM8K test fixture {GSM8K_TEST} is absent (test-only data)"
)
def test_real_gsm8k_file():
    problems = load_gsm8k(GSM8K_TEST, limit=10_000)
    assert len(problems) == 1319 and all(parse_number(gold) is not None for _, gold in problems)
    # the official calculator annotations <<expr=result>> replay through our calculator
    pairs = [
        pair
        for line in GSM8K_TEST.read_text(encoding="utf-8").splitlines()
        for pair in re.findall(r"<<([^<>=]*)=([^<>]*)>>", json.loads(line)["answer"])
    ]
    agree = sum(_agrees(expr, result) for expr, result in pairs) / len(pairs)
    print(f"GSM8K annotations replayed: {agree:.4f} of {len(pairs)}")
    assert agree > 0.99


def _agrees(expr: str, result: str) -> bool:
    try:
        return numbers_match(safe_calculate(expr), result, tol=1e-4)
    except CalculatorError:
        return False
