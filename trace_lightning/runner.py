"""The multi-turn ReAct runner: plays episodes of an `Environment` through a `GenerationEngine`.

Tokens in, tokens out. A prefix H_t is the prompt's chat-templated tokens followed, for every turn,
by the tokens the policy generated (its thought and one action tag; trainable) and the tokens of
the environment's reply (an observation wrapped as a user turn, ending with the assistant header
of the next turn; masked everywhere). The runner never re-tokenises what the policy generated: the
decoded text is only parsed for the action.

Episodes end with a named stop reason: whatever the environment says ("answer", ...), or
"turn_cap" (max_turns reached), "length_cap" (the episode's tokens reached max_episode_tokens),
"token_budget" (the iteration's token budget ran out), or a fault of the environment: "env_error"
(step raised), "env_timeout" (step ran past `step_timeout`) or "env_invalid" (step returned something
that is not a well-formed `Transition`, e.g. a NaN reward). Only an environment verdict can earn a
reward; every cap and every fault scores 0. A fault fails its episode, never the iteration.

Model output is hostile input, and so is what a tool makes of it. Everything the environment does
for a turn runs inside the episode's fault boundary: its step, and the tokenising of its observation.
Any `Exception`, and `SystemExit` (a tool that parses its arguments with argparse), ends only that
episode, as "env_error"; `KeyboardInterrupt` still stops the run. A step that returns after
`step_timeout` (a tool that held the GIL past it) is "env_timeout" all the same: its result is dropped.

Observations longer than `max_observation_chars` are cut to that length before tokenising (a search
tool that returns a whole web page must not blow the episode's context), and their token ids are then
cut to the room the episode has left under `max_episode_tokens` (4,000 characters of one code point
can be 16,000 tokens); either cut is marked and counted. Stop reasons an environment gives become
metric keys, so they are normalised where they enter (`stop_reason_key`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from trace_lightning.budget import BudgetLedger
from trace_lightning.chat import observation_parts, prompt_ids
from trace_lightning.engines.base import GenerationEngine, SamplingParams
from trace_lightning.envs.base import Environment, HasPromptIds, Task, Transition, transition_problem
from trace_lightning.envs.calls import MAX_ERROR_CHARS, StepTimeout, call_with_timeout, describe_error
from trace_lightning.iteration import Branch
from trace_lightning.tree import RolloutTree, Stage


@dataclass
class RolloutCounters:
    """What the runner saw in one iteration; the DataModule reports and resets it."""

    stop_reasons: Counter[str] = field(default_factory=Counter)
    turns: int = 0
    format_errors: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_errors: list[str] = field(default_factory=list)  # what the environment raised, for the log
    env_timeouts: int = 0  # steps abandoned after `step_timeout` seconds
    invalid_transitions: list[str] = field(default_factory=list)  # why each rejected transition was garbage
    truncated_observations: int = 0  # observations cut to `max_observation_chars` or to the episode's room
    budget_bound_turns: int = 0  # turns the token budget cut: held below max_new_tokens, a reply ran into it

    def merge(self, other: RolloutCounters) -> None:
        """Add another process's counts (multi-process iterations report the whole iteration)."""
        self.stop_reasons.update(other.stop_reasons)
        self.env_errors += other.env_errors
        self.invalid_transitions += other.invalid_transitions
        for name in (
            "turns",
            "format_errors",
            "tool_calls",
            "tool_errors",
            "env_timeouts",
            "truncated_observations",
            "budget_bound_turns",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))


TRUNCATION_MARK = " [...truncated]"
MAX_STOP_REASON_CHARS = 64
_NOT_KEY_SAFE = re.compile(r"[^A-Za-z0-9_-]")
KNOWN_CONTEXT = 10**8  # a tokenizer's model_max_length above this is transformers' "unknown" (1e30)


def stop_reason_key(reason: str) -> str:
    """An environment's stop reason as a safe metric-key segment (`rollout/stop/<reason>`): characters
    outside [A-Za-z0-9_-] become "_", at most 64 are kept, and an empty reason is "env_invalid". MLflow
    refuses keys with other characters, a `//`, a leading or trailing `/` or a `..` segment, and the
    logger would then raise mid-run: `stop_reason_key("../../etc/passwd") == "______etc_passwd"`."""
    return _NOT_KEY_SAFE.sub("_", reason)[:MAX_STOP_REASON_CHARS] or "env_invalid"


def context_tokens(tokenizer: Any) -> int | None:
    """The model's context in tokens, when its tokenizer knows it (`model_max_length`), else None."""
    size = getattr(tokenizer, "model_max_length", None)
    return size if isinstance(size, int) and 0 < size <= KNOWN_CONTEXT else None


@dataclass(frozen=True)
class EpisodeLimits:
    """Where an episode is cut, and how long the environment may take: part of the `data` group.

    max_turns: policy turns per episode. max_episode_tokens: generated + observation tokens per episode.
    step_timeout: seconds an environment step may take (None: no limit; it then fails as env_timeout).
    max_observation_chars: longer tool output is cut to this before tokenising.
    """

    max_turns: int = 3
    max_episode_tokens: int = 768
    step_timeout: float | None = 30.0
    max_observation_chars: int = 4000

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"data.max_turns={self.max_turns} must be >= 1")
        if self.max_episode_tokens < 1:
            raise ValueError(f"data.max_episode_tokens={self.max_episode_tokens} must be >= 1")
        timeout = self.step_timeout
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(
                f"data.step_timeout={timeout} must be a positive number of seconds, or null for no limit"
            )
        if self.max_observation_chars < 1:
            raise ValueError(f"data.max_observation_chars={self.max_observation_chars} must be >= 1")

    def limits(self) -> EpisodeLimits:
        """Only the episode limits (a subclass such as `data.DataSettings` carries more)."""
        return EpisodeLimits(
            self.max_turns, self.max_episode_tokens, self.step_timeout, self.max_observation_chars
        )


@dataclass
class _Episode:
    tree: RolloutTree
    node_id: int
    stage: Stage
    task: Task
    turns: int  # turns taken so far on this path (= depth of node_id)
    tokens: int  # generated + observation tokens so far on this path


class ReActRunner:
    """Runs branches to termination, one batched engine call per turn across all live episodes."""

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer: Any,
        env: Environment,
        sampling: SamplingParams,
        limits: EpisodeLimits = EpisodeLimits(),
    ) -> None:
        self.engine, self.tokenizer, self.env = engine, tokenizer, env
        self.sampling = replace(sampling, stop=tuple(dict.fromkeys((*sampling.stop, *env.stop_strings))))
        self.max_turns, self.max_episode_tokens = limits.max_turns, limits.max_episode_tokens
        self.step_timeout, self.max_observation_chars = limits.step_timeout, limits.max_observation_chars
        self.tasks = {t.task_id: t for t in env.tasks()}
        self.env_name = str(getattr(env, "name", None) or type(env).__name__)  # named in env_errors
        self.context = context_tokens(tokenizer)
        self.counters = RolloutCounters()
        self.on_episode_end: Callable[[], None] | None = None  # a progress display's hook, if any
        # and another, after each batched turn: (turns played, episodes still running). Batched episodes
        # tend to end together, so a display shows the turns meanwhile.
        self.on_turn: Callable[[int, int], None] | None = None

    def take_counters(self) -> RolloutCounters:
        """The counters since the last call, which start again from zero."""
        counters, self.counters = self.counters, RolloutCounters()
        return counters

    def prompt_ids(self, task: Task) -> list[int]:
        """The chat-templated prompt (system + user question + assistant header)."""
        return task_prompt_ids(self.tokenizer, self.env, task)

    def new_tree(self, task_id: int) -> RolloutTree:
        task = self.tasks[task_id]
        tree = RolloutTree(task_id, self.prompt_ids(task))
        tree.env_states[0] = self.env.initial_state(task)
        return tree

    def __call__(self, branches: Sequence[Branch], ledger: BudgetLedger, rng: np.random.Generator) -> None:
        live = [self._start(b) for b in branches for _ in range(b.count)]
        played = 0
        while any_busy(self.engine, bool(live)):  # rounds: one batched engine call per turn
            live, played = self._turn(live, ledger), played + 1
            if self.on_turn is not None:
                self.on_turn(played, len(live))

    def _start(self, branch: Branch) -> _Episode:
        tree = branch.tree
        tokens = len(tree.token_ids(branch.node_id)) - len(tree.prompt_ids)
        depth = tree.nodes[branch.node_id].depth
        return _Episode(tree, branch.node_id, branch.stage, self.tasks[tree.task_id], depth, tokens)

    def _turn(self, live: list[_Episode], ledger: BudgetLedger) -> list[_Episode]:
        """One policy turn for every live episode; returns those that go on. `generate` is called even
        with no episode left (an empty list), since a group-synchronous engine must be called in every
        round by every member (`any_busy`); the other engines return at once."""
        budget_left = ledger.tokens_left()
        share = self.sampling.max_new_tokens if budget_left is None else budget_left // max(len(live), 1)
        cap = min(self.sampling.max_new_tokens, share)
        if cap < 1:  # the iteration's token budget cannot give every live episode one more token
            for ep in live:
                self._close(ep, ep.node_id, "token_budget")
            live = []
        params = replace(self.sampling, max_new_tokens=max(cap, 1))
        completions = self.engine.generate([ep.tree.token_ids(ep.node_id) for ep in live], params)
        # Only a reply that ran into a cap the budget lowered was cut by it; a lowered cap that every reply
        # stopped short of bound nothing (counting it made `budget.unit=tokens` shrink a run's leaves each
        # iteration while it spent half its tokens).
        if cap < self.sampling.max_new_tokens and any(c.finish_reason == "length" for c in completions):
            self.counters.budget_bound_turns += 1
        going = []
        for ep, completion in zip(live, completions, strict=True):
            # One batched call serves episodes with different room left: each keeps only what fits its
            # own max_episode_tokens (the rest is cut, as a length cap would have), and pays for that.
            keep = max(self._room(ep), 1)
            action_ids = completion.token_ids[:keep]
            ledger.charge_tokens(len(action_ids), ep.stage, ep.turns + 1)
            if self._advance(ep, action_ids, completion.logprobs[:keep]):
                going.append(ep)
        return going

    def _advance(self, ep: _Episode, action_ids: list[int], logprobs: list[float]) -> bool:
        """Apply one turn to the environment and the tree. True when the episode continues."""
        self.counters.turns += 1
        text = self.tokenizer.decode(action_ids, skip_special_tokens=True)
        reply = self._reply(ep, action_ids, text)
        if isinstance(reply, str):  # a faulty environment fails the episode, never the iteration
            self._close(ep, ep.tree.add_turn(ep.node_id, ep.stage, list(action_ids), [], logprobs), reply)
            return False
        tr, obs_ids = reply
        self._count(tr, empty=not action_ids)
        node = ep.tree.add_turn(ep.node_id, ep.stage, list(action_ids), obs_ids, logprobs)
        ep.tree.env_states[node] = tr.state
        ep.node_id, ep.turns, ep.tokens = node, ep.turns + 1, ep.tokens + len(action_ids) + len(obs_ids)
        if tr.done:
            reason = stop_reason_key(tr.stop_reason or "done")
            self._close(ep, node, reason, reward=float(tr.reward))  # type: ignore[arg-type]
        elif ep.turns >= self.max_turns:
            self._close(ep, node, "turn_cap")
        elif self._room(ep) <= 0:
            self._close(ep, node, "length_cap")
        else:
            return True
        return False

    def _room(self, ep: _Episode) -> int:
        """Tokens the episode may still add: what `max_episode_tokens` leaves, never past the context."""
        room = self.max_episode_tokens - ep.tokens
        if self.context is not None:
            room = min(room, self.context - len(ep.tree.prompt_ids) - ep.tokens)
        return room

    def _reply(self, ep: _Episode, action_ids: list[int], text: str) -> tuple[Transition, list[int]] | str:
        """The environment's checked transition and its observation's ids, or the stop reason of the fault
        that ends the episode. Tokenising is inside the fault boundary too: what a tool returns can make
        the tokenizer raise."""
        tr = self._step(ep.task, ep.tree.env_states[ep.node_id], text)
        if isinstance(tr, str):
            return tr
        if tr.done:
            return tr, []
        try:
            return tr, self._observation_ids(tr.observation, action_ids, self._room(ep) - len(action_ids))
        except (Exception, SystemExit) as err:
            return self._env_error(err, "tokenizing its observation")

    def _step(self, task: Task, state: Any, text: str) -> Transition | str:
        """The environment's checked transition, or the stop reason of the fault that ends the episode."""
        try:
            tr = call_with_timeout(lambda: self.env.step(task, state, text), self.step_timeout)
        except StepTimeout:
            self.counters.env_timeouts += 1
            return "env_timeout"
        except (Exception, SystemExit) as err:  # SystemExit: a tool that parses its arguments with argparse
            return self._env_error(err, "env.step")
        problem = transition_problem(tr)
        if problem is not None:
            self.counters.invalid_transitions.append(problem[:MAX_ERROR_CHARS])
            return "env_invalid"
        return tr

    def _bounded(self, observation: str) -> str:
        """The observation cut to `max_observation_chars` (marked as cut, so the policy can tell)."""
        limit = self.max_observation_chars
        if len(observation) <= limit:
            return observation
        self.counters.truncated_observations += 1
        if limit <= len(TRUNCATION_MARK):
            return observation[:limit]
        return observation[: limit - len(TRUNCATION_MARK)] + TRUNCATION_MARK

    def _env_error(self, err: BaseException, where: str) -> str:
        """Records what the environment raised, naming it and where, and returns the stop reason."""
        self.counters.env_errors.append(f"{describe_error(err)} (env={self.env_name}, in {where})")
        return "env_error"

    def _observation_ids(self, observation: str, action_ids: list[int], room: int) -> list[int]:
        """The environment's reply as a user turn, then the header of the next assistant turn, in at most
        `room` tokens: when it does not fit, the observation's own tokens are cut and marked, the
        template's markup around them kept while it fits. A cut by characters or tokens counts once."""
        text = self._bounded(observation)
        head, body, tail = observation_parts(self.tokenizer, text, action_ids)
        if len(head) + len(body) + len(tail) <= room:
            return [*head, *body, *tail]
        self.counters.truncated_observations += int(len(text) == len(observation))  # else counted already
        mark = self.tokenizer(TRUNCATION_MARK, add_special_tokens=False)["input_ids"]
        keep = max(room - len(head) - len(mark) - len(tail), 0)
        return [*head, *body[:keep], *mark, *tail][: max(room, 0)]

    def _count(self, tr: Transition, empty: bool) -> None:
        # A turn of zero tokens holds no action, whatever the environment made of the empty text.
        self.counters.format_errors += int(tr.format_error or empty)
        self.counters.tool_calls += int(tr.tool is not None)
        self.counters.tool_errors += int(tr.tool_error)

    def _close(self, ep: _Episode, node: int, reason: str, reward: float = 0.0) -> None:
        if node == 0 or ep.tree.nodes[node].children:
            node = ep.tree.add_turn(node, ep.stage, [], [])  # a leaf must be a fresh, childless turn
        ep.tree.finish(node, reward, reason)
        self.counters.stop_reasons[reason] += 1
        if self.on_episode_end is not None:
            self.on_episode_end()


def any_busy(engine: GenerationEngine, busy: bool) -> bool:
    """Whether the runner plays another round: `busy` (this process has live episodes), or, for an
    engine whose `generate` is a collective of several processes (vLLM with tensor parallelism, see
    engines/colocate.py), whether any of them has."""
    group_busy = getattr(engine, "any_busy", None)
    return busy if group_busy is None else bool(group_busy(busy))


def task_prompt_ids(tokenizer: Any, env: Environment, task: Task) -> list[int]:
    """The task's prompt as the runner plays it: the environment's own where it builds one per task
    (`env.prompt_ids(task, tokenizer)`: bfcl's function docs differ by entry), else `prompt_ids`."""
    if isinstance(env, HasPromptIds):
        return list(env.prompt_ids(task, tokenizer))
    return prompt_ids(tokenizer, env.system_prompt, task.question)
