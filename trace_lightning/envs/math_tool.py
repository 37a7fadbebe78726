"""Arithmetic word problems with a calculator tool: seeded generated problems or GSM8K.

The calculator walks the expression's `ast` and evaluates only numbers and arithmetic operators, so
model text is never handed to `eval`. Sizes are bounded at every node (exponent, magnitude, length),
so no expression can hang the process or exhaust memory. The optional `python` tool (off by default)
runs model-written programs in `sandbox.run_python`, in a bubblewrap jail, never in this process; the
env refuses to start with the tool on where no jail can be set up.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Literal

from trace_lightning.envs.actions import ActionError, parse_action
from trace_lightning.envs.base import Task, Transition
from trace_lightning.envs.sandbox import SandboxLimits, check_sandbox, format_observation, run_python
from trace_lightning.envs.scoring import numbers_match

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e15

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


class CalculatorError(ValueError):
    """The expression is not plain bounded arithmetic; the message is shown to the model."""


def safe_calculate(expr: str) -> str:
    """Evaluate `expr` as arithmetic and format the result ("12*7" -> "84", "1/3" -> "0.333333").

    Forgiving of how people write sums: "$", thousands commas, "×", "÷" and "^" (as power) are
    accepted. Raises `CalculatorError` for anything else.
    """
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = _THOUSANDS_COMMA.sub("", expr.replace("$", "")).strip()
    text = text.replace("×", "*").replace("÷", "/").replace("^", "**")
    if not text:
        raise CalculatorError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("not a valid arithmetic expression") from None
    return _format(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalculatorError("only numbers are allowed")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        return _bounded(result)
    raise CalculatorError(f"unsupported element {type(node).__name__}: use numbers and + - * / // % ** ( )")


def _bounded(value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):  # e.g. (-8) ** 0.5 is complex
        raise CalculatorError("result is not a real number")
    # compare the magnitude first: math.isfinite on an int beyond float range raises OverflowError
    if abs(value) > MAX_MAGNITUDE or not math.isfinite(value):
        raise CalculatorError(f"number larger than {MAX_MAGNITUDE:.0e}")
    return value


def _format(value: float) -> str:
    if isinstance(value, int) or value.is_integer():
        return str(int(value))
    fixed = f"{value:.6f}".rstrip("0").rstrip(".")
    return fixed if fixed not in ("0", "-0") else f"{value:.6g}"


_NAMES = ("Tom", "Mia", "Sam", "Ana", "Leo", "Zoe", "Ben", "Ivy", "Max", "Eva")
_ITEMS = ("apples", "books", "coins", "marbles", "stickers", "pencils", "cookies", "cards")
# difficulty -> (operations in the story, operand range, multiplier range, allowed operations)
_LEVELS = {
    1: (1, (2, 20), (2, 3), ("add", "sub")),
    2: (2, (5, 60), (2, 5), ("add", "sub", "mul")),
    3: (3, (20, 200), (2, 9), ("add", "sub", "mul", "div")),
    4: (4, (20, 200), (2, 9), ("add", "sub", "mul", "div")),
    5: (5, (20, 500), (2, 12), ("add", "sub", "mul", "div")),
}


def generate_problems(n: int, difficulty: int = 1, seed: int = 0) -> list[tuple[str, str]]:
    """`n` seeded word problems with exact non-negative integer answers, as (question, gold).

    Difficulty 1 is one addition or subtraction of numbers up to 20 ("Tom has 12 apples and buys 7
    more."); 2 chains two steps with numbers up to 60 and multiplication; 3 chains three steps with
    numbers up to 200 and exact division; 4 chains four such steps; 5 chains five, numbers up to 500.
    Questions are distinct, so no held-out problem is also a training problem; a level with fewer
    distinct problems than `n` is refused.
    """
    if difficulty not in _LEVELS:
        raise ValueError(f"env.difficulty must be one of {sorted(_LEVELS)}, got {difficulty}")
    rng = random.Random(seed)
    problems: dict[str, str] = {}
    for _ in range(20 * n):
        question, gold = _problem(rng, difficulty)
        problems.setdefault(question, gold)
        if len(problems) == n:
            return list(problems.items())
    raise ValueError(
        f"env.n_tasks={n}: difficulty {difficulty} has only about {len(problems)} distinct problems; "
        "ask for fewer tasks or a higher env.difficulty"
    )


# each level of a mixture draws from its own stream: seed + stride * level (an int difficulty keeps `seed`)
_LEVEL_SEED_STRIDE = 1_000_003


def generate_mixed_problems(
    n: int, difficulties: Sequence[int], weights: Sequence[float] | None = None, seed: int = 0
) -> list[tuple[str, str]]:
    """`n` problems drawn from several difficulty levels, as (question, gold), in a seeded order.

    Level `d` gets a share of `n` proportional to its weight (equal by default), rounded by largest
    remainder with ties to the earlier levels: n=10 over [1, 2, 3] gives 4, 3, 3. Each share is
    `generate_problems(share, d, seed + _LEVEL_SEED_STRIDE * d)`; the levels are then interleaved by
    `random.Random(seed).shuffle`. A level-d question has exactly d steps, so levels never share one.
    """
    levels = [_level(d) for d in difficulties]
    if not levels:
        raise ValueError("env.difficulty=[] names no level: give an int 1-5 or a list such as [1, 2, 3]")
    if len(set(levels)) < len(levels):
        raise ValueError(
            f"env.difficulty={levels} repeats a level: list each once, weight it with env.difficulty_weights"
        )
    shares = _shares(n, _weights(weights, len(levels)))
    problems: list[tuple[str, str]] = []
    for level, share in zip(levels, shares, strict=True):
        if share == 0:
            raise ValueError(
                f"env.n_tasks={n} leaves difficulty {level} no task (shares {shares} over "
                f"env.difficulty={levels}): raise env.n_tasks or its env.difficulty_weights"
            )
        problems += generate_problems(share, level, seed + _LEVEL_SEED_STRIDE * level)
    if len({question for question, _ in problems}) < n:  # guards a future _LEVELS with equal step counts
        raise ValueError(
            f"env.difficulty={levels}: two levels generated the same question; mix levels of distinct steps"
        )
    random.Random(seed).shuffle(problems)
    return problems


def _level(difficulty: object) -> int:
    try:
        level = operator.index(difficulty)  # ints (and numpy ints); refuses 1.5 and "2"
    except TypeError:
        raise ValueError(f"env.difficulty: levels are ints {sorted(_LEVELS)}, got {difficulty!r}") from None
    if level not in _LEVELS:
        raise ValueError(f"env.difficulty levels must be among {sorted(_LEVELS)}, got {level}")
    return level


def _weights(weights: Sequence[float] | None, n_levels: int) -> list[float]:
    if weights is None:
        return [1.0] * n_levels
    try:
        values = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise ValueError(f"env.difficulty_weights={weights!r} must be a list of numbers > 0") from None
    if len(values) != n_levels:
        raise ValueError(
            f"env.difficulty_weights has {len(values)} weights for {n_levels} levels: "
            "give one per env.difficulty level"
        )
    if not all(math.isfinite(w) and w > 0 for w in values):
        raise ValueError(
            f"env.difficulty_weights={values} must all be > 0: drop a level from env.difficulty instead"
        )
    return values


def _shares(n: int, weights: Sequence[float]) -> list[int]:
    """Largest-remainder split of `n` by `weights`, ties to earlier levels: 10 by [1, 1, 1] -> [4, 3, 3]."""
    quotas = [n * w / sum(weights) for w in weights]
    shares = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (shares[i] - quotas[i], i))
    for i in by_remainder[: n - sum(shares)]:
        shares[i] += 1
    return shares


def _problem(rng: random.Random, difficulty: int) -> tuple[str, str]:
    steps, (low, high), (k_low, k_high), ops = _LEVELS[difficulty]
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    value = rng.randint(low, high)
    sentences = [f"{name} has {value} {item}."]
    for _ in range(steps):
        op = rng.choice(ops)
        divisors = [k for k in range(k_low, k_high + 1) if value % k == 0]
        if op == "div" and not divisors:
            op = "mul"
        if op == "sub" and value < 2:
            op = "add"
        if op == "add":
            b = rng.randint(low, high)
            value, text = value + b, f"Then {name} buys {b} more."
        elif op == "sub":
            b = rng.randint(1, min(high, value - 1))
            value, text = value - b, f"Then {name} gives away {b}."
        elif op == "mul":
            k = rng.randint(k_low, k_high)
            value, text = value * k, f"Then {name} ends up with {k} times as many."
        else:
            k = rng.choice(divisors)
            value, text = (
                value // k,
                f"Then {name} splits them into {k} equal groups and keeps one group.",
            )
        sentences.append(text)
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences), str(value)


_START = re.compile(r"^\w+ has (\d+) ")
_STEPS = (
    (re.compile(r"buys (\d+) more"), "+"),
    (re.compile(r"gives away (\d+)"), "-"),
    (re.compile(r"ends up with (\d+) times as many"), "*"),
    (re.compile(r"splits them into (\d+) equal groups"), "/"),
)


def generated_steps(question: str) -> tuple[str, list[tuple[str, str]]] | None:
    """(starting number, [(operator, number), ...]) that a generated word problem spells out, or None.

    Reads the sentences `generate_problems` writes; any other text (a GSM8K problem) gives None.
    """
    start = _START.match(question)
    if start is None:
        return None
    steps = []
    for sentence in question.split(". ")[1:]:
        for pattern, op in _STEPS:
            if (m := pattern.search(sentence)) is not None:
                steps.append((op, m.group(1)))
                break
    return start.group(1), steps


def generated_attributes(question: str, gold: str) -> tuple[str, ...]:
    """("steps=N", "hard_ops=K", "magnitude=D") of a generated problem, coarse to fine; () for other text.

    N counts the operations, K those that are * or /, D the digits of the gold answer: "Tom has 12 apples.
    Then Tom buys 7 more. How many apples does Tom have now?" with gold "19" -> ("steps=1", "hard_ops=0",
    "magnitude=2"). A GSM8K question can begin like a generated one ("John has 3 boxes."), so the text
    counts as generated only when every middle sentence is a step and the steps replay to the gold.
    """
    read = generated_steps(question)
    if read is None or question.count(". ") != len(read[1]) + 1:
        return ()
    start, steps = read
    try:
        value, target = Fraction(start), Fraction(gold)
        for op, number in steps:
            value = _REPLAY[op](value, Fraction(number))
    except (ValueError, ZeroDivisionError):
        return ()
    if value != target or value.denominator != 1:
        return ()
    hard = sum(op in "*/" for op, _ in steps)
    return f"steps={len(steps)}", f"hard_ops={hard}", f"magnitude={len(str(abs(value.numerator)))}"


_REPLAY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def strip_annotations(solution: str) -> str:
    """GSM8K solutions carry calculator annotations: "48/2 = <<48/2=24>>24" -> "48/2 = 24"."""
    return re.sub(r"<<[^<>]*>>", "", solution)


def parse_gsm8k_answer(answer: str) -> tuple[str, str]:
    """(worked solution without annotations, gold number) from a GSM8K answer ending "#### 72"."""
    if "####" not in answer:
        raise ValueError("GSM8K answer has no '#### <number>' line")
    solution, _, gold = answer.rpartition("####")
    gold = gold.strip().replace(",", "")
    if not gold:
        raise ValueError("GSM8K answer has an empty '####' line")
    return strip_annotations(solution).strip(), gold


def load_gsm8k(path: str | Path | None, limit: int) -> list[tuple[str, str]]:
    """(question, gold) pairs from the first `limit` lines of a GSM8K jsonl file."""
    if path is None:
        raise ValueError("env.gsm8k_path is not set: point it at a GSM8K jsonl file (source='gsm8k')")
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"env.gsm8k_path={str(path)!r} is not a file (GSM8K jsonl expected)")
    problems: list[tuple[str, str]] = []
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if len(problems) == limit:
                break
            if line.strip():
                problems.append(_gsm8k_record(line, f"env.gsm8k_path={str(path)!r} line {number}"))
    if not problems:
        raise ValueError(f"env.gsm8k_path={str(path)!r} holds no problems")
    return problems


def _gsm8k_record(line: str, where: str) -> tuple[str, str]:
    try:
        record = json.loads(line)
        return str(record["question"]).strip(), parse_gsm8k_answer(str(record["answer"]))[1]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"{where}: not a GSM8K record {{'question', 'answer': '... #### N'}} ({err})"
        ) from err


SYSTEM_PROMPT = (
    "Solve the math problem. Think step by step, then end your turn with exactly one action: "
    "<calculate>expression</calculate> to compute arithmetic (numbers and + - * / ** ( ) only), or "
    "<answer>number</answer> to give the final answer. Results come back as <observation>...</observation>."
)
SYSTEM_PROMPT_WITH_PYTHON = (
    "Solve the math problem. Think step by step, then end your turn with exactly one action: "
    "<calculate>expression</calculate> to compute arithmetic (numbers and + - * / ** ( ) only), "
    "<python>code</python> to run a short Python program (standard library only, no network; print the "
    "values you need), or <answer>number</answer> to give the final answer. Results come back as "
    "<observation>...</observation>."
)


class MathToolEnv:
    """Word problems solved with a calculator; reward 1.0 when the answered number is the gold.

    State: `(tool calls so far,)`. The episode ends on `<answer>`; the runner caps the turns. With
    `python_tool=True` the model may also write `<python>code</python>`, run under `sandbox` limits.
    `held_out`: how many tasks the seeded split sets aside for evaluation (`data.held_out` and the warm
    start's `held_out` read it from the config); the env only checks it.
    """

    name = "math_tool"
    system_prompt = SYSTEM_PROMPT
    stop_strings: tuple[str, ...] = ("</calculate>", "</answer>")
    actions: tuple[str, ...] = ("calculate", "answer")

    def __init__(
        self,
        source: Literal["generated", "gsm8k"] = "generated",
        gsm8k_path: str | None = None,
        n_tasks: int = 256,
        difficulty: int | Sequence[int] = 1,
        seed: int = 0,
        python_tool: bool = False,
        sandbox: SandboxLimits | None = None,
        held_out: int = 16,
        difficulty_weights: Sequence[float] | None = None,
    ) -> None:
        # `env.sandbox` (the config always has one) only matters with env.python_tool=true
        if sandbox is not None and not isinstance(sandbox, SandboxLimits):
            raise TypeError("env.sandbox needs `_target_: trace_lightning.envs.sandbox.SandboxLimits`")
        self._sandbox = (sandbox or SandboxLimits()) if python_tool else None
        if self._sandbox is not None:  # fail closed: no tool at all where no jail can be set up
            check_sandbox(self._sandbox)
        if python_tool:  # the prompt and the stop strings mention the tool only when it exists
            self.system_prompt = SYSTEM_PROMPT_WITH_PYTHON
            self.stop_strings = ("</calculate>", "</python>", "</answer>")
            self.actions = ("calculate", "python", "answer")
        if n_tasks < 1:
            raise ValueError(f"env.n_tasks must be >= 1, got {n_tasks}")
        if source == "generated":
            problems = _generated(n_tasks, difficulty, difficulty_weights, seed)
        elif source == "gsm8k":
            problems = load_gsm8k(gsm8k_path, n_tasks)
        else:
            raise ValueError(f"env.source must be 'generated' or 'gsm8k', got {source!r}")
        self._tasks = [Task(i, question, (gold,)) for i, (question, gold) in enumerate(problems)]
        if held_out < 0:  # only checked: data.held_out and the warm start read it (and split the tasks)
            raise ValueError(f"env.held_out={held_out} must be >= 0 (tasks set aside for evaluation)")
        self.held_out = held_out

    def tasks(self) -> Sequence[Task]:
        return self._tasks

    def attributes(self, task: Task) -> tuple[str, ...]:
        """Steps, multiplications and divisions, and answer digits, coarse to fine (`HasAttributes`);
        () for a GSM8K task. See `generated_attributes`."""
        return generated_attributes(task.question, task.answer[0])

    def initial_state(self, task: Task) -> tuple[int]:
        return (0,)

    def step(self, task: Task, state: tuple[int], action_text: str) -> Transition:
        action = parse_action(action_text, self.actions)
        if isinstance(action, ActionError):
            return Transition(
                _observe(f"error: {action.message}"), False, None, None, state, format_error=True
            )
        if action.name == "answer":
            reward = float(numbers_match(action.argument, task.answer[0]))
            return Transition("", True, reward, "answer", state, tool="answer")
        calls = (state[0] + 1,)
        if action.name == "python":
            return self._python(action.argument, calls)
        try:
            result = safe_calculate(action.argument)
        except CalculatorError as err:
            return Transition(
                _observe(f"error: {err}"), False, None, None, calls, tool="calculate", tool_error=True
            )
        return Transition(_observe(f"= {result}"), False, None, None, calls, tool="calculate")

    def demonstration(self, task: Task) -> list[str] | None:
        """The warm start's demonstration: one `<calculate>` per step the problem spells out, each on
        the calculator's previous result (its real output), then the gold; a story with no step is one
        call that confirms the number. None where the text does not determine the steps (GSM8K) or the
        calculator's last result is not the gold."""
        read = generated_steps(task.question)
        if read is None:
            return None
        value, steps = read
        state, actions = self.initial_state(task), []
        for op, number in steps or [("", "")]:
            action = (
                f"<calculate>{value} {op} {number}</calculate>" if op else f"<calculate>{value}</calculate>"
            )
            tr = self.step(task, state, action)
            shown = re.fullmatch(r"<observation>= (-?[\d.]+)</observation>", tr.observation)
            if tr.done or tr.tool_error or shown is None:
                return None
            state, value = tr.state, shown.group(1)
            actions.append(action)
        if not numbers_match(value, task.answer[0]):
            return None
        return [*actions, f"<answer>{task.answer[0]}</answer>"]

    def _python(self, code: str, calls: tuple[int]) -> Transition:
        assert self._sandbox is not None  # "python" is an allowed action only when the tool is on
        result = run_python(code, self._sandbox)
        observation = format_observation(result)
        return Transition(observation, False, None, None, calls, tool="python", tool_error=not result.ok)


def _generated(
    n: int, difficulty: int | Sequence[int], weights: Sequence[float] | None, seed: int
) -> list[tuple[str, str]]:
    # an int keeps the single-level stream bit for bit (tests and warm starts depend on it); Hydra hands
    # a list over as a ListConfig, any Sequence of ints is a mixture
    if isinstance(difficulty, Sequence) and not isinstance(difficulty, str):
        return generate_mixed_problems(n, list(difficulty), weights, seed)
    if weights is not None:
        raise ValueError(
            f"env.difficulty_weights={list(weights)} needs a list env.difficulty (e.g. [1, 2, 3]); "
            f"with env.difficulty={difficulty} set it to null"
        )
    return generate_problems(n, difficulty=_level(difficulty), seed=seed)


def _observe(text: str) -> str:
    return f"<observation>{text}</observation>"
