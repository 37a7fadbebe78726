"""The multi-turn ReAct runner: plays episodes of an `Environment` through a `GenerationEngine`.

Tokens in, tokens out. A prefix H_t is the prompt's chat-templated tokens followed, for every turn,
by the tokens the policy generated (its thought and one action tag; trainable) and the tokens of
the environment's reply (an observation wrapped as a user turn, ending with the assistant header
of the next turn; masked everywhere). The runner never re-tokenises what the policy generated: the
decoded text is only parsed for the action.

Episodes end with a named stop reason: whatever the environment says ("answer", ...), or
"turn_cap" (max_turns reached), "length_cap" (the episode's tokens reached max_episode_tokens),
"token_budget" (the iteration's token budget ran out) or "env_error" (the environment raised).
Only an environment verdict can earn a reward; every cap scores 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

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
        max_turns: int = 4,
        max_episode_tokens: int = 512,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"rollout.max_turns={max_turns} must be >= 1")
        if max_episode_tokens < 1:
            raise ValueError(f"rollout.max_episode_tokens={max_episode_tokens} must be >= 1")
        self.engine, self.tokenizer, self.env = engine, tokenizer, env
        self.sampling = replace(sampling, stop=tuple(dict.fromkeys((*sampling.stop, *env.stop_strings))))
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.tasks = {t.task_id: t for t in env.tasks()}
        self.counters = RolloutCounters()

    def prompt_ids(self, task: Task) -> list[int]:
        """The chat-templated prompt (system + user question + assistant header)."""
        messages = [
            {"role": "system", "content": self.env.system_prompt},
            {"role": "user", "content": task.question},
        ]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def new_tree(self, task_id: int) -> RolloutTree:
        task = self.tasks[task_id]
        tree = RolloutTree(task_id, self.prompt_ids(task))
        tree.env_states[0] = self.env.initial_state(task)
        return tree

    def __call__(self, branches: Sequence[Branch], ledger: BudgetLedger, rng: np.random.Generator) -> None:
        live = [self._start(b) for b in branches for _ in range(b.count)]
        while live:
            live = self._turn(live, ledger)

    def _start(self, branch: Branch) -> _Episode:
        tree = branch.tree
        tokens = len(tree.token_ids(branch.node_id)) - len(tree.prompt_ids)
        depth = tree.nodes[branch.node_id].depth
        return _Episode(tree, branch.node_id, branch.stage, self.tasks[tree.task_id], depth, tokens)

    def _turn(self, live: list[_Episode], ledger: BudgetLedger) -> list[_Episode]:
        """One policy turn for every live episode; returns those that go on."""
        budget_left = ledger.tokens_left()
        share = self.sampling.max_new_tokens if budget_left is None else budget_left // len(live)
        cap = min(self.sampling.max_new_tokens, share, *(self.max_episode_tokens - ep.tokens for ep in live))
        if cap < 1:  # the iteration's token budget cannot give every live episode one more token
            for ep in live:
                self._close(ep, ep.node_id, "token_budget")
            return []
        params = replace(self.sampling, max_new_tokens=cap)
        completions = self.engine.generate([ep.tree.token_ids(ep.node_id) for ep in live], params)
        going = []
        for ep, completion in zip(live, completions, strict=True):
            ledger.charge_tokens(len(completion.token_ids), ep.stage, ep.turns + 1)
            if self._advance(ep, completion.token_ids):
                going.append(ep)
        return going

    def _advance(self, ep: _Episode, action_ids: list[int]) -> bool:
        """Apply one turn to the environment and the tree. True when the episode continues."""
        self.counters.turns += 1
        state = ep.tree.env_states[ep.node_id]
        text = self.tokenizer.decode(action_ids, skip_special_tokens=True)
        try:
            tr = self.env.step(ep.task, state, text)
        except Exception as err:  # a faulty environment fails the episode, never the iteration
            node = ep.tree.add_turn(ep.node_id, ep.stage, list(action_ids), [])
            self._close(ep, node, "env_error")
            self.counters.env_errors.append(f"{type(err).__name__}: {err}")
            return False
        self._count(tr)
        obs_ids = [] if tr.done else self._observation_ids(tr.observation, action_ids)
        node = ep.tree.add_turn(ep.node_id, ep.stage, list(action_ids), obs_ids)
        ep.tree.env_states[node] = tr.state
        ep.node_id, ep.turns, ep.tokens = node, ep.turns + 1, ep.tokens + len(action_ids) + len(obs_ids)
        if tr.done:
            self._close(ep, node, tr.stop_reason or "done", reward=tr.reward or 0.0)
        elif ep.turns >= self.max_turns:
            self._close(ep, node, "turn_cap")
        elif ep.tokens >= self.max_episode_tokens:
            self._close(ep, node, "length_cap")
        else:
            return True
        return False

    def _observation_ids(self, observation: str, action_ids: list[int]) -> list[int]:
        """The environment's reply as a user turn, then the header of the next assistant turn."""
        eos = self.tokenizer.eos_token_id
        closed = bool(action_ids) and action_ids[-1] == eos
        text = (
            "" if closed else "<|im_end|>"
        ) + f"\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _count(self, tr: Transition) -> None:
        self.counters.format_errors += int(tr.format_error)
        self.counters.tool_calls += int(tr.tool is not None)
        self.counters.tool_errors += int(tr.tool_error)

    def _close(self, ep: _Episode, node: int, reason: str, reward: float = 0.0) -> None:
        if node == 0 or ep.tree.nodes[node].children or ep.tree.nodes[node].reward is not None:
            node = ep.tree.add_turn(node, ep.stage, [], [])  # a leaf must be a fresh, childless turn
        ep.tree.finish(node, reward, reason)
        self.counters.stop_reasons[reason] += 1
