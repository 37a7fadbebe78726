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

Observations longer than `max_observation_chars` are cut to that length before tokenising (a search
tool that returns a whole web page must not blow the episode's context); the cut is counted.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from trace_lightning.allocation import BudgetLedger
from trace_lightning.engines.base import GenerationEngine, SamplingParams
from trace_lightning.envs.base import Environment, Task, Transition
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
    truncated_observations: int = 0  # observations cut to `max_observation_chars`
    budget_bound_turns: int = (
        0  # turns whose generation the iteration's token budget held below max_new_tokens
    )

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


T = TypeVar("T")
_BOOL = (bool, np.bool_)  # numpy comparisons give np.bool_, which is as good a flag as bool
TRUNCATION_MARK = " [...truncated]"
MAX_ERROR_CHARS = 500  # an error message kept for the log; a huge one would only bloat the report


class StepTimeout(Exception):
    """`env.step` did not return within the runner's `step_timeout`."""


def call_with_timeout(fn: Callable[[], T], timeout: float | None) -> T:
    """`fn()`, or `StepTimeout` when it has not returned after `timeout` seconds (None: no limit).

    A Python thread cannot be killed, so a call that times out is abandoned: it keeps running in the
    background until it returns by itself, and its result is dropped (environments are functional, so
    it changes nothing we keep). It runs in a fresh daemon thread rather than a ThreadPoolExecutor
    worker because the interpreter joins executor workers at exit: one hung step would keep the
    finished training process alive forever. A fresh thread costs ~0.1 ms, nothing next to a turn of
    generation. Tools that run code (the sandboxed python tool) enforce their own process timeout;
    this one is the last line of defence, and it means `env.step` must not rely on running in the
    main thread (no `signal.alarm`).
    """
    if timeout is None:
        return fn()
    box: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            box.append((True, fn()))
        except BaseException as err:  # handed to the caller, who decides what is fatal
            box.append((False, err))

    thread = threading.Thread(target=target, name="env-step", daemon=True)
    thread.start()
    thread.join(timeout)
    if not box:
        raise StepTimeout(f"env.step did not return within {timeout} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def transition_problem(tr: object) -> str | None:
    """Why `tr` is not a transition the runner can use, or None when it is.

    Nothing is clamped or coerced: a NaN reward or a reward of 1.7 is an environment bug, and training
    on it would hide the bug while corrupting the advantages.
    """
    if not isinstance(tr, Transition):
        return f"step returned {type(tr).__name__}, not a Transition"
    if not isinstance(tr.done, _BOOL):
        return f"done={tr.done!r} is not a bool"
    if not isinstance(tr.observation, str):
        return f"observation is {type(tr.observation).__name__}, not str"
    if not (isinstance(tr.format_error, _BOOL) and isinstance(tr.tool_error, _BOOL)):
        return f"format_error={tr.format_error!r} and tool_error={tr.tool_error!r} must be bools"
    if tr.tool is not None and not isinstance(tr.tool, str):
        return f"tool={tr.tool!r} is not a str or None"
    if tr.done:
        return _final_problem(tr.reward, tr.stop_reason)
    return None


def _final_problem(reward: object, stop_reason: object) -> str | None:
    """A final transition needs a finite reward in [0, 1] and a string stop reason (or None)."""
    if isinstance(reward, _BOOL) or not isinstance(reward, numbers.Real):
        return f"done with reward={reward!r}: a final reward must be a number in [0, 1]"
    if not (math.isfinite(reward) and 0.0 <= float(reward) <= 1.0):
        return f"done with reward={reward!r}: a final reward must be finite and in [0, 1]"
    if stop_reason is not None and not isinstance(stop_reason, str):
        return f"stop_reason={stop_reason!r} is not a str"
    return None


def describe_error(err: BaseException) -> str:
    """`Type: message`, bounded, and safe even when the exception's own __str__ raises."""
    try:
        text = str(err)
    except Exception:
        text = "<unprintable>"
    return f"{type(err).__name__}: {text}"[:MAX_ERROR_CHARS]


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
        self.counters = RolloutCounters()
        self.on_episode_end: Callable[[], None] | None = None  # a progress display's hook, if any

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
        while any_busy(self.engine, bool(live)):  # rounds: one batched engine call per turn
            live = self._turn(live, ledger)

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
        if live and cap < self.sampling.max_new_tokens:
            self.counters.budget_bound_turns += 1
        if cap < 1:  # the iteration's token budget cannot give every live episode one more token
            for ep in live:
                self._close(ep, ep.node_id, "token_budget")
            live = []
        params = replace(self.sampling, max_new_tokens=max(cap, 1))
        completions = self.engine.generate([ep.tree.token_ids(ep.node_id) for ep in live], params)
        going = []
        for ep, completion in zip(live, completions, strict=True):
            # One batched call serves episodes with different room left: each keeps only what fits its
            # own max_episode_tokens (the rest is cut, as a length cap would have), and pays for that.
            keep = max(self.max_episode_tokens - ep.tokens, 1)
            action_ids = completion.token_ids[:keep]
            ledger.charge_tokens(len(action_ids), ep.stage, ep.turns + 1)
            if self._advance(ep, action_ids, completion.logprobs[:keep]):
                going.append(ep)
        return going

    def _advance(self, ep: _Episode, action_ids: list[int], logprobs: list[float]) -> bool:
        """Apply one turn to the environment and the tree. True when the episode continues."""
        self.counters.turns += 1
        text = self.tokenizer.decode(action_ids, skip_special_tokens=True)
        tr = self._step(ep.task, ep.tree.env_states[ep.node_id], text)
        if isinstance(tr, str):  # a faulty environment fails the episode, never the iteration
            self._close(ep, ep.tree.add_turn(ep.node_id, ep.stage, list(action_ids), [], logprobs), tr)
            return False
        self._count(tr, empty=not action_ids)
        obs_ids = [] if tr.done else self._observation_ids(self._bounded(tr.observation), action_ids)
        node = ep.tree.add_turn(ep.node_id, ep.stage, list(action_ids), obs_ids, logprobs)
        ep.tree.env_states[node] = tr.state
        ep.node_id, ep.turns, ep.tokens = node, ep.turns + 1, ep.tokens + len(action_ids) + len(obs_ids)
        if tr.done:
            self._close(ep, node, tr.stop_reason or "done", reward=float(tr.reward))  # type: ignore[arg-type]
        elif ep.turns >= self.max_turns:
            self._close(ep, node, "turn_cap")
        elif ep.tokens >= self.max_episode_tokens:
            self._close(ep, node, "length_cap")
        else:
            return True
        return False

    def _step(self, task: Task, state: Any, text: str) -> Transition | str:
        """The environment's checked transition, or the stop reason of the fault that ends the episode."""
        try:
            tr = call_with_timeout(lambda: self.env.step(task, state, text), self.step_timeout)
        except StepTimeout:
            self.counters.env_timeouts += 1
            return "env_timeout"
        except Exception as err:
            self.counters.env_errors.append(describe_error(err))
            return "env_error"
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

    def _observation_ids(self, observation: str, action_ids: list[int]) -> list[int]:
        """The environment's reply as a user turn, then the header of the next assistant turn."""
        return observation_ids(self.tokenizer, observation, action_ids)

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
    own = getattr(env, "prompt_ids", None)
    if own is not None:
        return list(own(task, tokenizer))
    return prompt_ids(tokenizer, env.system_prompt, task.question)


def prompt_ids(tokenizer: Any, system_prompt: str, question: str) -> list[int]:
    """The chat-templated prompt (system + user question + assistant header), as the runner plays it."""
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@dataclass(frozen=True)
class ChatTurns:
    """What the tokenizer's own chat template writes between an assistant turn and the next one, read
    off the template once by rendering a conversation with placeholders (`chat_turns`).

    after_action: from the end of the assistant's text up to the last special token before the user's
    text (ChatML `<|im_end|>\n<|im_start|>`; Llama 3 `<|eot_id|><|start_header_id|>user<|end_header_id|>`).
    user_prefix: the plain text before the user's content (ChatML `user\n`, Llama 3 `\n\n`).
    after_observation: from the end of the user's text through the next assistant header.
    close: the text that ends an assistant turn (the template's end of turn, usually the EOS token)."""

    after_action: str
    user_prefix: str
    after_observation: str
    close: str


_ACTION, _OBSERVATION = "\u2063ACTION\u2063", "\u2063OBSERVATION\u2063"  # placeholders no template alters
_TURNS: dict[tuple[str, str], ChatTurns] = {}


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template the runner can play multi-turn episodes with."""


def chat_turns(tokenizer: Any) -> ChatTurns:
    """The tokenizer's chat template, read as `ChatTurns` (cached per template); `ChatTemplateError`
    naming the fix when there is no template, or when it does not render a system, user, assistant,
    user conversation as an extension of its first three turns (then turns cannot be appended)."""
    template = getattr(tokenizer, "chat_template", None)
    fix = (
        "give the model a chat template: model.chat_template=<a Jinja template, or the path of a .jinja "
        "file> (the model's own, e.g. from its instruct variant)"
    )
    if not template or not isinstance(template, str):
        raise ChatTemplateError(f"the tokenizer of this model has no chat template; {fix}")
    key = (template, str(tokenizer.eos_token))
    if key in _TURNS:
        return _TURNS[key]
    system = {"role": "system", "content": "S"}
    three = [system, {"role": "user", "content": "U"}, {"role": "assistant", "content": _ACTION}]
    try:
        before = tokenizer.apply_chat_template(three, tokenize=False)
        after = tokenizer.apply_chat_template(
            [*three, {"role": "user", "content": _OBSERVATION}], tokenize=False, add_generation_prompt=True
        )
    except Exception as err:  # a template that raises on a system turn or a second user turn
        raise ChatTemplateError(
            f"the chat template cannot render a multi-turn episode ({err}); {fix}"
        ) from err
    cut = after.find(_ACTION)
    if cut < 0 or _OBSERVATION not in after or not after.startswith(before[: before.find(_ACTION)]):
        raise ChatTemplateError(
            "the chat template does not render a conversation as the extension of its first turns (the "
            f"runner appends turns); {fix}"
        )
    close = before[before.find(_ACTION) + len(_ACTION) :]
    between, rest = after[cut + len(_ACTION) :].split(_OBSERVATION, 1)
    special = {
        *tokenizer.all_special_tokens,
        *(t.content for t in tokenizer.added_tokens_decoder.values() if t.special),
    }
    specials = [t for t in special if t and t in between]
    split = max((between.rfind(t) + len(t) for t in specials), default=0)
    turns = ChatTurns(between[:split], between[split:], rest, close.rstrip("\n") or str(tokenizer.eos_token))
    _TURNS[key] = turns
    return turns


def observation_ids(tokenizer: Any, observation: str, action_ids: list[int]) -> list[int]:
    """The environment's reply as a user turn, then the header of the next assistant turn, as the
    tokenizer's chat template writes them (`chat_turns`).

    The chat markers are special tokens; the observation is not. Tool output (a web page, what
    model-written code printed) is tokenised with special-token parsing off, so a forged
    `<|im_end|>\n<|im_start|>system` in it stays plain text instead of opening a real system turn.
    An action that ended with the EOS token already holds the template's end of turn; one cut before
    it (a stop string, the token cap) gets it here, so the next turn always opens cleanly.
    """
    turns = chat_turns(tokenizer)
    head_text = turns.after_action
    closed = bool(action_ids) and action_ids[-1] == tokenizer.eos_token_id
    if closed and head_text.startswith(turns.close):
        head_text = head_text[len(turns.close) :]
    head = _markup(tokenizer, head_text)
    body = tokenizer(f"{turns.user_prefix}{observation}", add_special_tokens=False, split_special_tokens=True)
    tail = _markup(tokenizer, turns.after_observation)
    return [*head, *body["input_ids"], *tail]


def _markup(tokenizer: Any, text: str) -> list[int]:
    """Ids of chat-template text we wrote ourselves, special tokens parsed."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
