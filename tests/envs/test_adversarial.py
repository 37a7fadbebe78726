"""Hostile model output against every shipped environment, and what the BFCL simulations may build.

A policy writes anything: numbers JSON reads as infinities, integers of thousands of digits, brackets
nested a thousand deep, a megabyte in one turn, tags left open or nested, ten thousand calls in one
turn. Each environment must answer each with a valid transition, quickly, and never raise (the runner
would end the episode as `env_error`, but that is the last line of defence, not the design).

BFCL runs the model's calls in this process, on pure-Python simulations, so it has bounds of its
own (envs/bfcl/world.py): the world a call leaves (`max_world_chars`, counted as a listing would
print it, because `cp` shares subtrees and a few dozen calls can make the listing exponential), the
arguments that scale a call's work (they hold the GIL, so no thread timeout could stop them), and the
module-level data of the simulations, which no episode may change for the next one.
"""

from __future__ import annotations

import copy
import decimal
import importlib
import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from trace_lightning.envs.base import Transition, transition_problem
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.envs.math_tool import MathToolEnv

pytest.importorskip("bfcl_eval", reason="the BFCL data ships in bfcl-eval: run `make install`")

from trace_lightning.envs.bfcl import BFCLEnv
from trace_lightning.envs.bfcl import world as bfcl_world
from trace_lightning.envs.bfcl.data import SUBSETS, Call, load_entries

STEP_SECONDS = 2.0  # every hostile step here takes milliseconds; a hang or a GIL-holding call takes far more


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


HOSTILE: dict[str, Callable[[str], str]] = {
    "non_finite": lambda tag: f"<{tag}>1e999 NaN -Infinity</{tag}>",
    "json_non_finite": lambda tag: f'<{tag}>{{"name": "x", "arguments": {{"v": 1e999, "w": NaN}}}}</{tag}>',
    "huge_int": lambda tag: f"<{tag}>{'9' * 5000}</{tag}>",
    "json_huge_int": lambda tag: f'<{tag}>{{"name": "x", "arguments": {{"v": {"9" * 5000}}}}}</{tag}>',
    "deep": lambda tag: f"<{tag}>" + "[" * 990 + "]" * 990 + f"</{tag}>",
    "json_deep": lambda tag: f'<{tag}>{{"name": "x", "arguments": {{"v": {"[" * 990 + "]" * 990}}}}}</{tag}>',
    "power_tower": lambda tag: f"<{tag}>9**9**9**9</{tag}>",
    "megabyte": lambda tag: f"<{tag}>" + "x" * 1_000_000 + f"</{tag}>",
    "megabyte_untagged": lambda tag: "y" * 1_000_000,
    "unterminated": lambda tag: f"<{tag}>1 + 1",
    "nested": lambda tag: f"<{tag}><{tag}>1</{tag}></{tag}>",
    "flood": lambda tag: f"<{tag}>1</{tag}>" * 10_000,
}


def shipped(name: str) -> Any:
    if name == "search_qa":
        from trace_lightning.envs.search_qa import SearchQAEnv

        return SearchQAEnv()
    if name == "bfcl":
        return BFCLEnv("base")
    return {"chain": ChainEnv(n_tasks=4), "math_tool": MathToolEnv(n_tasks=4, difficulty=2)}[name]


@pytest.fixture(scope="module", params=["search_qa", "math_tool", "bfcl", "chain"])
def env(request: pytest.FixtureRequest) -> Any:
    """The environment after one benign step in each of its tags: what it builds on its first call
    (search_qa's BM25 index, about 2 s on a busy machine) is not what the deadline measures."""
    built = shipped(request.param)
    task = next(iter(built.tasks()))
    for tag in [s.strip("</>") for s in built.stop_strings]:
        built.step(task, built.initial_state(task), f"<{tag}>warm up</{tag}>")
    return built


class TestHostileActions:
    """Every kind of hostile text, in every tag of every shipped environment, on its first two tasks."""

    @pytest.mark.parametrize("kind", list(HOSTILE))
    def test_answered_with_a_valid_transition_in_time(self, env: Any, kind: str) -> None:
        for task in list(env.tasks())[:2]:
            state = env.initial_state(task)
            for tag in [s.strip("</>") for s in env.stop_strings]:
                began = time.perf_counter()
                tr = env.step(task, state, HOSTILE[kind](tag))
                assert time.perf_counter() - began < STEP_SECONDS, f"{kind} in <{tag}> took too long"
                assert transition_problem(tr) is None, f"{kind} in <{tag}>: {transition_problem(tr)}"
                if not tr.done:  # the episode goes on from the state it left
                    hash(tr.state)
                    assert transition_problem(env.step(task, tr.state, "I am not sure.")) is None

    def test_the_same_action_every_turn_ends_within_the_caps(self, env: Any) -> None:
        """A policy that repeats one bad call forever: each step stays valid, nothing raises."""
        task = next(iter(env.tasks()))
        state, tag = env.initial_state(task), env.stop_strings[0].strip("</>")
        for _ in range(50):
            tr = env.step(task, state, HOSTILE["json_non_finite"](tag))
            assert transition_problem(tr) is None
            if tr.done:
                break
            state = tr.state


def cp_entry(env: BFCLEnv) -> Any:
    """A base task whose file system offers `cp` (most exclude it)."""
    return next(t for t in env.tasks() if "cp" in bfcl_world.owners(env.entries[t.task_id]))


def doubling() -> list[str]:
    """`d0` holds one file; `cp d<k> d<k+1>` twice makes d<k+1> hold d<k>'s items and d<k> itself,
    sharing the subtrees: the listing doubles every two calls while the objects grow by a few."""
    out = [
        call("mkdir", dir_name="d0"),
        call("cd", folder="d0"),
        call("touch", file_name="f"),
        call("cd", folder=".."),
    ]
    for k in range(40):
        out += [call("cp", source=f"d{k}", destination=f"d{k + 1}")] * 2
    return out


class TestBFCLWorldBound:
    def test_exponential_growth_ends_the_episode_at_the_world_cap(self) -> None:
        env = BFCLEnv("base", max_calls_per_turn=200)
        task = cp_entry(env)
        state = env.initial_state(task)
        for i, action in enumerate(doubling()):  # noqa: B007 (read after the loop)
            tr = env.step(task, state, action)
            assert not tr.tool_error or tr.done, tr.observation  # every call of the sequence is valid
            if tr.done:
                break
            state = tr.state
        assert tr.done and tr.stop_reason == "world_cap" and tr.reward == 0.0, tr.observation[:300]
        assert "env.max_world_chars" in tr.observation
        assert i < 40  # 2**20 items: the cap (1,000,000 characters) stops it after ~20 doublings
        entry, cap = env.entries[task.task_id], env.replay.max_world_chars
        for (entry_id, _), (instances, results) in env.replay._items.items():  # nothing past the cap kept
            assert entry_id == entry.entry_id
            assert bfcl_world.world_size(instances, cap) <= cap and all(len(r) <= cap for r in results)
        found = env.step(task, state, call("find", path="."))  # the listing of the largest world kept
        assert not found.done and len(found.observation) <= cap

    def test_world_size_counts_shared_subtrees_once_per_path_and_stops_at_the_cap(self) -> None:
        leaf = ["x" * 8]  # 10 + 2
        shared = [leaf, leaf]  # 2 + 2 * 12 = 26
        assert bfcl_world.world_size(shared, 10**6) == 26
        assert bfcl_world.world_size([shared, shared], 10**6) == 2 + 2 * 26
        loop: list[Any] = ["ab"]
        loop.append(loop)  # a parent pointer: not followed back
        assert bfcl_world.world_size(loop, 10**6) == 2 + 4
        tower: list[Any] = [leaf]
        for _ in range(200):  # 2**200 paths: the walk must stop at the cap, not enumerate them
            tower = [tower, tower]
        began = time.perf_counter()
        assert 10**5 < bfcl_world.world_size(tower, 10**5) < 10**5 + 100
        assert time.perf_counter() - began < 1.0

    def test_the_ground_truth_fits_well_inside_the_default_cap(self) -> None:
        for subset in SUBSETS:
            replay = bfcl_world.Replay(4)
            for entry in load_entries(subset):
                calls = tuple(c for turn in entry.ground_truth for c in turn)
                instances, results = replay.after(entry, calls)
                assert bfcl_world.world_size(instances, 10**6) < bfcl_world.MAX_WORLD_CHARS / 10
                assert max(map(len, results), default=0) < bfcl_world.MAX_WORLD_CHARS / 10


def math_task(env: BFCLEnv) -> Any:
    return next(t for t in env.tasks() if "MathAPI" in env.entries[t.task_id].classes)


class TestBFCLArguments:
    @pytest.mark.parametrize(
        ("name", "arguments"),
        [
            ("power", {"base": 2, "exponent": 10**9}),
            ("power", {"base": 10**15, "exponent": 1000}),
            ("power", {"base": 7.0, "exponent": 10**12}),
            ("square_root", {"number": 2, "precision": 10**8}),
            ("logarithm", {"value": 2, "base": 10, "precision": 10**8}),
            ("round_number", {"number": 12345, "decimal_places": -(10**9)}),
        ],
    )
    def test_calls_that_would_hold_the_gil_are_refused_before_they_run(
        self, name: str, arguments: dict
    ) -> None:
        env = BFCLEnv("base")
        task = math_task(env)
        began = time.perf_counter()
        tr = env.step(task, env.initial_state(task), call(name, **arguments))
        assert time.perf_counter() - began < 0.5
        assert tr.tool_error and not tr.done
        assert "at most" in tr.observation or "the limit is" in tr.observation, tr.observation

    def test_the_bounds_leave_ordinary_math_alone(self) -> None:
        env = BFCLEnv("base")
        task = math_task(env)
        for name, arguments, expected in [
            ("power", {"base": 2, "exponent": 10}, '"result": 1024}'),
            ("square_root", {"number": 16, "precision": 5}, "Decimal('4')"),
            ("round_number", {"number": 3.14159, "decimal_places": 2}, '"result": 3.14}'),
        ]:
            tr = env.step(task, env.initial_state(task), call(name, **arguments))
            assert not tr.tool_error and expected in tr.observation, tr.observation

    @pytest.mark.parametrize(
        "value", ["1e999", "NaN", "-Infinity", "9" * 5000, "9" * 20, "[" * 990 + "]" * 990]
    )
    def test_non_finite_huge_and_deep_arguments_are_format_errors_and_run_nothing(self, value: str) -> None:
        env = BFCLEnv("base")
        task = math_task(env)
        state = env.initial_state(task)
        tr = env.step(
            task,
            state,
            f'<tool_call>{{"name": "absolute_value", "arguments": {{"number": {value}}}}}</tool_call>',
        )
        assert tr.format_error and not tr.done and tr.state.calls == state.calls

    def test_a_flood_of_calls_in_one_turn_runs_one_and_a_flood_of_turns_hits_the_call_cap(self) -> None:
        env = BFCLEnv("base", max_calls_per_turn=5)
        task = math_task(env)
        state = env.initial_state(task)
        tr = env.step(task, state, call("absolute_value", number=-1) * 10_000)
        assert len(tr.state.calls) == 1
        for _ in range(5):
            state = tr.state
            tr = env.step(task, state, call("absolute_value", number=-1))
        assert tr.done and tr.stop_reason == "call_cap" and tr.reward == 0.0


def module_globals() -> dict[str, Any]:
    """A deep copy of every mutable module-level value of the simulations, and the global precisions."""
    out: dict[str, Any] = {"mpmath.dps": importlib.import_module("mpmath").mp.dps}
    out["decimal.prec"] = decimal.getcontext().prec
    modules = {m for m, _ in bfcl_world.API_CLASSES.values()} | {"long_context"}
    for name in sorted(modules):
        module = importlib.import_module(f"{bfcl_world.API_PACKAGE}.{name}")
        for key, value in vars(module).items():
            if not key.startswith("__") and isinstance(value, (dict, list, set)):
                out[f"{name}.{key}"] = copy.deepcopy(value)
    return out


class TestBFCLIsolation:
    def test_replaying_every_entry_of_every_subset_leaves_the_module_globals_unchanged(self) -> None:
        before = module_globals()
        replay = bfcl_world.Replay(8)
        for subset in SUBSETS:
            for entry in load_entries(subset):
                calls = tuple(c for turn in entry.ground_truth for c in turn)
                for k in range(len(calls) + 1):
                    replay.after(entry, calls[:k])
        after = module_globals()
        changed = sorted(k for k in before if before[k] != after[k])
        assert not changed, f"replays changed module-level state: {changed}"

    def test_a_call_on_one_episode_cannot_change_what_another_loads(self) -> None:
        """cancel_booking refunds a card; in long_context the card is module data by reference."""
        entry = next(e for e in load_entries("long_context") if "TravelAPI" in e.classes)
        pristine = bfcl_world.fresh_instances(entry)["TravelAPI"].credit_card_list
        instances = bfcl_world.fresh_instances(entry)
        travel = instances["TravelAPI"]
        for booking in list(travel.booking_record):
            cancel = Call.make("cancel_booking", {"access_token": travel.access_token, "booking_id": booking})
            bfcl_world.execute(instances, bfcl_world.owners(entry), cancel)
        assert travel.credit_card_list != pristine  # the refunds happened, on this episode's world only
        assert bfcl_world.fresh_instances(entry)["TravelAPI"].credit_card_list == pristine

    def test_the_checker_replays_the_same_ground_truth_after_any_episode(self) -> None:
        """Each long_context entry's ground truth passes, before and after every other entry's replay."""
        env = BFCLEnv("long_context")
        first = {n: bfcl_world.Replay(1).after(e, _all_calls(e))[1] for n, e in env.entries.items()}
        for entry in env.entries.values():
            env.replay.after(entry, _all_calls(entry))
        again = {n: bfcl_world.Replay(1).after(e, _all_calls(e))[1] for n, e in env.entries.items()}
        assert first == again


def _all_calls(entry: Any) -> tuple[Call, ...]:
    return tuple(c for turn in entry.ground_truth for c in turn)


def test_a_step_that_raises_memory_or_recursion_errors_is_reported_by_the_check() -> None:
    """A user's environment that blows up on a hostile call is named by `check_environment`."""
    from trace_lightning.envs.check import check_environment

    class Fragile(ChainEnv):
        def step(self, task: Any, state: Any, action_text: str) -> Transition:
            if "NaN" in action_text:
                raise MemoryError("built a world too big")
            return super().step(task, state, action_text)

    problems = check_environment(Fragile(n_tasks=2))
    assert any("MemoryError" in p for p in problems), problems
