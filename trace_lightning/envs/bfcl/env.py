"""`env=bfcl`: BFCL v4 multi-turn function calling (the paper's third scenario), stateful and branchable.

An episode is a whole BFCL conversation. The prompt holds the function docs and the first user turn
(`prompt.py`); in each user turn the policy makes calls, one per policy turn (an optional short
thought, then `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), and each call's execution
result (or error) is the next observation. A policy turn without a call is a reply that ends the user
turn: the checker runs (`checker.py`), and the next user message arrives as the observation. The
episode ends after the last user turn, with BFCL's verdict as the reward (1.0 only if every turn
passed), or earlier with reward 0 when a user turn reaches `max_calls_per_turn` call attempts and the
policy tries one more (BFCL force-quits the entry after 20 steps in a turn: `call_cap`).

Calls are parsed with `json` (never `eval`); only functions documented for the entry (its classes'
docs less `excluded_function`) run, as public methods of their API class (`world.py`). In
miss_func a held-out function is shown only from its reveal turn, but it can be called before, as
BFCL's executor allows (one ground truth, miss_func_49, calls `tail` two turns before revealing it).
Whatever goes wrong —
malformed JSON, an unknown or private name, a bad argument, an exception inside the API — becomes an
error observation, never a crash. (BFCL's own inference loop ends the user turn on a response it
cannot decode; we show the error and let the policy retry within the cap.)

State: `BFCLState`, immutable. The APIs themselves are rebuilt from (entry id, calls executed so far) by
replay (`world.Replay`, cached), so a continuation from any turn prefix sees that prefix's state.
The final state carries every turn's verdict: `diagnostics` reads turns passed, state score and call
overlap from it.

Data: `bfcl-eval==2026.3.23` (Apache-2.0; `make install` installs it with --no-deps). Task ids are the
entries' numbers (multi_turn_base_17 -> 17); `data.held_out` 40 of the 200 (20%) with the run's seed is
the 80/20 split (docs/bfcl.md).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from trace_lightning.envs.base import Task, Transition
from trace_lightning.envs.bfcl.checker import (
    TurnVerdict,
    call_overlap,
    check_turn,
    official_reward,
    state_score,
    turns_reward,
)
from trace_lightning.envs.bfcl.data import Call, Entry, load_entries
from trace_lightning.envs.bfcl.prompt import (
    SYSTEM_PROMPT,
    TEMPLATE_SYSTEM_PROMPT,
    choose_level,
    docs_for,
    new_functions_message,
    system_prompt,
    template_has_tools,
    tool_schemas,
)
from trace_lightning.envs.bfcl.world import (
    ERROR_PREFIX,
    MAX_WORLD_CHARS,
    CallRejected,
    Replay,
    WorldTooLarge,
    api_class,
    owners,
    shown,
)
from trace_lightning.envs.tools import BadCall, parse_hermes

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
CALL_FORMAT = '<tool_call>{"name": "<function>", "arguments": {"<parameter>": <value>}}</tool_call>'
MAX_CALL_CHARS = 32000  # long_context ground truths post ~7k-character contents
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class BFCLState:
    """Where a conversation stands. (entry, calls) is the replay key of the APIs' state."""

    entry: str  # the entry id, e.g. "multi_turn_base_17"
    calls: tuple[Call, ...] = ()  # every call executed so far, all turns, in order
    turn: int = 0  # the user turn in progress
    steps: int = 0  # call attempts in this user turn (executed, rejected or malformed)
    called: bool = False  # a call was made in this user turn (BFCL: the turn's response is not empty)
    verdicts: tuple[TurnVerdict, ...] = ()  # one per finished user turn


@dataclass(frozen=True)
class Malformed:
    message: str  # what is wrong and what to write instead (shown to the policy)


@dataclass(frozen=True)
class Reply:
    text: str  # a turn without a call: the reply that ends the user turn


def parse_move(text: str) -> Call | Malformed | Reply:
    """One policy turn: the first `<tool_call>...</tool_call>` as a call (parsed by the hermes parser of
    envs/tools.py, the one every typed-tool environment uses), or a reply if there is none.

    Example: `parse_move('Moving it. <tool_call>{"name": "mv", "arguments": {"source": "a",
    "destination": "b"}}</tool_call>')` gives `Call.make("mv", {"source": "a", "destination": "b"})`.
    """
    parsed = parse_hermes(text, CALL_FORMAT, MAX_CALL_CHARS)
    if parsed is None:
        return Reply(text.strip())
    if isinstance(parsed, BadCall):
        return Malformed(parsed.message)
    if not _NAME.fullmatch(parsed.name):
        return Malformed(f'the call needs a "name" that is a function name: write {CALL_FORMAT}')
    return Call.make(parsed.name, parsed.arguments)


DONE_REPLY = "Done."  # the demonstrations' reply ending a user turn whose request the calls fulfilled
CANNOT_REPLY = (
    "I cannot do that with the functions I have, or a value I need is missing. Please tell me more."
)


def call_text(call: Call) -> str:
    """The call as the policy writes it (keyword arguments only)."""
    args, kwargs = call.values()
    if args:
        raise ValueError(f"{call.text()} has positional arguments: bind them first (keyword_call)")
    return f"{TOOL_OPEN}{json.dumps({'name': call.name, 'arguments': kwargs})}{TOOL_CLOSE}"


def keyword_call(entry: Entry, call: Call) -> Call:
    """A ground-truth call with its positional arguments named (`sort('a')` -> `sort(file_name='a')`),
    as the policy would write it."""
    args, kwargs = call.values()
    if not args:
        return call
    method = getattr(api_class(owners(entry)[call.name]), call.name)
    bound = inspect.signature(method).bind(None, *args, **kwargs)  # None stands for self
    return Call.make(call.name, dict(list(bound.arguments.items())[1:]))


class BFCLEnv:
    """BFCL v4 multi-turn entries of one subset as episodes; see the module docstring.

    Args:
        subset: base, long_context, miss_func or miss_param.
        held_out: entries the 80/20 split holds out (20% of 200, as the paper). The env only checks it:
            `data.held_out` and the warm start's `held_out` read this value from `conf/env/bfcl.yaml`.
        max_calls_per_turn: call attempts allowed in one user turn; one more ends the episode (reward 0).
        max_doc_chars: the system prompt (instructions + docs) is kept within this many characters by
            choosing the richest doc level that fits (full, compact, signatures; prompt.py).
        reward: "official" (BFCL's verdict, 0/1) or "turns" (the share of user turns that passed).
        replay_cache: API states kept for replay (world.Replay).
        max_world_chars: the largest simulated world a call may leave, as `world.world_size` counts
            it; a call past it ends the episode with reward 0 (stop reason `world_cap`).
    """

    name = "bfcl"
    system_prompt = SYSTEM_PROMPT  # the instructions alone; `prompt_ids` adds each entry's docs
    stop_strings = (TOOL_CLOSE,)

    def __init__(
        self,
        subset: str = "base",
        held_out: int = 40,
        max_calls_per_turn: int = 40,
        max_doc_chars: int = 16000,
        reward: Literal["official", "turns"] = "official",
        replay_cache: int = 256,
        max_world_chars: int = MAX_WORLD_CHARS,
    ) -> None:
        if max_calls_per_turn < 1:
            raise ValueError(f"env.max_calls_per_turn={max_calls_per_turn} must be >= 1")
        if reward not in ("official", "turns"):
            raise ValueError(f"env.reward must be 'official' or 'turns', got {reward!r}")
        self.subset, self.max_calls_per_turn, self.reward = subset, max_calls_per_turn, reward
        self.entries = {e.number: e for e in load_entries(subset)}
        if not 0 <= held_out < len(self.entries):
            raise ValueError(f"env.held_out={held_out} must be in [0, {len(self.entries) - 1}]")
        self.held_out = held_out
        self.replay = Replay(replay_cache, max_world_chars)
        self.levels = {n: self._level(e, max_doc_chars) for n, e in self.entries.items()}
        self._tasks = [Task(n, e.turns[0], _truth_text(e)) for n, e in self.entries.items()]

    @staticmethod
    def _level(entry: Entry, max_doc_chars: int) -> str:
        level = choose_level(docs_for(list(shown(entry, 0).items())), max_doc_chars)
        if level is None:
            raise ValueError(
                f"env.max_doc_chars={max_doc_chars} is too small for {entry.entry_id}'s docs even as "
                "signatures: raise it"
            )
        return level

    def tasks(self) -> Sequence[Task]:
        return self._tasks

    def initial_state(self, task: Task) -> BFCLState:
        return BFCLState(self.entries[task.task_id].entry_id)

    def prompt_ids(self, task: Task, tokenizer: Any) -> list[int]:
        """The chat-templated prompt: system (instructions and docs) + the first user turn + the
        assistant header; the docs through the template's `tools` where it has a tool format."""
        entry, level = self.entries[task.task_id], self.levels[task.task_id]
        docs = docs_for(list(shown(entry, 0).items()))
        tools = template_has_tools(tokenizer)
        system = TEMPLATE_SYSTEM_PROMPT if tools else system_prompt(docs, level)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": entry.turns[0]}]
        extra = {"tools": tool_schemas(docs, level)} if tools else {}
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def demonstration(self, task: Task) -> list[str]:
        """The warm start's demonstration: the entry's ground-truth calls, one `<tool_call>` per policy
        turn as the policy writes them, and a reply ending each user turn ("Done.", or saying it cannot
        where the ground truth makes no call). The warm start keeps it when BFCL's verdict is 1.0."""
        entry, actions = self.entries[task.task_id], []
        for turn in entry.ground_truth:
            actions += [call_text(keyword_call(entry, call)) for call in turn]
            actions.append(DONE_REPLY if turn else CANNOT_REPLY)
        return actions

    def step(self, task: Task, state: BFCLState, action_text: str) -> Transition:
        entry = self.entries[task.task_id]
        move = parse_move(action_text)
        if isinstance(move, Reply):
            return self._end_turn(entry, state)
        if state.steps >= self.max_calls_per_turn:  # BFCL force-quits: the entry fails
            return Transition("", True, 0.0, "call_cap", state)
        if isinstance(move, Malformed):
            return _observe(
                f"Error: {move.message}", replace(state, steps=state.steps + 1), format_error=True
            )
        tried = replace(state, steps=state.steps + 1, called=True)
        try:
            _, results = self.replay.extend(entry, state.calls, move, owners(entry))
        except CallRejected as err:
            return _observe(f"Error: {err}", tried, tool=move.name, tool_error=True)
        except WorldTooLarge as err:  # the state would not fit: nothing is kept, the entry fails
            return Transition(f"Error: {err}", True, 0.0, "world_cap", tried, tool=move.name, tool_error=True)
        done = replace(tried, calls=(*state.calls, move))
        return _observe(results[-1], done, tool=move.name, tool_error=results[-1].startswith(ERROR_PREFIX))

    def _end_turn(self, entry: Entry, state: BFCLState) -> Transition:
        verdicts = (*state.verdicts, self.verdict(entry, state))
        nxt = replace(state, turn=state.turn + 1, steps=0, called=False, verdicts=verdicts)
        if nxt.turn < len(entry.turns):
            return Transition(self._user_message(entry, nxt.turn), False, None, None, nxt)
        score = official_reward if self.reward == "official" else turns_reward
        return Transition("", True, score(verdicts, len(entry.turns)), "end", nxt)

    def verdict(self, entry: Entry, state: BFCLState) -> TurnVerdict:
        """BFCL's check of the user turn `state.turn`, which the policy has just ended."""
        model, results = self.replay.after(entry, state.calls)
        truth_calls = tuple(c for turn in entry.ground_truth[: state.turn + 1] for c in turn)
        truth, truth_results = self.replay.after(entry, truth_calls)
        this_turn = truth_results[len(truth_results) - len(entry.ground_truth[state.turn]) :]
        return check_turn(
            state.turn, model, truth, results, this_turn, state.called, bool(entry.ground_truth[state.turn])
        )

    def _user_message(self, entry: Entry, turn: int) -> str:
        if entry.turns[turn]:
            return entry.turns[turn]
        revealed = [(f, c) for f, c in shown(entry, turn).items() if f not in shown(entry, turn - 1)]
        return new_functions_message(docs_for(revealed), self.levels[entry.number])

    def diagnostics(self, task: Task, state: BFCLState) -> dict[str, float]:
        """Per-episode figures (logged, not rewarded by default): turns, turns passed, state score,
        call overlap with the ground truth, calls made."""
        entry = self.entries[task.task_id]
        who = owners(entry)
        truth = [(who[c.name], c) for turn in entry.ground_truth for c in turn]
        return {
            "turns": float(len(entry.turns)),
            "turns_reached": float(len(state.verdicts)),
            "turns_passed": float(sum(v.passed for v in state.verdicts)),
            "state_score": state_score(state.verdicts),
            "call_overlap": call_overlap([(who[c.name], c) for c in state.calls], truth),
            "calls": float(len(state.calls)),
        }


def _observe(text: str, state: BFCLState, **flags: Any) -> Transition:
    """A mid-episode transition whose observation is a call's result (or error), as a tool response."""
    return Transition(f"<tool_response>\n{text}\n</tool_response>", False, None, None, state, **flags)


def _truth_text(entry: Entry) -> tuple[str, ...]:
    """The ground truth, one string per user turn (Task.answer: for logs; the checker replays calls)."""
    return tuple("; ".join(c.text() for c in turn) for turn in entry.ground_truth)
