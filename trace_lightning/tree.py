"""The rollout tree of one prompt: one node per ReAct turn, leaves carry the terminal reward.

Node 0 is the prompt (depth 0, no tokens). A bare rollout is a chain root -> turn 1 -> ... -> leaf;
a continuation sampled from prefix H_t (TRACE Stage 2) is a new chain hanging under the node of
turn t. Node ids are assigned in creation order, so a parent's id is always smaller than its
children's: reverse id order is a valid bottom-up order, which `backup` uses.

Which tokens train (docs/algorithm.md#which-tokens-train): every node's action
tokens are trained exactly once, in the sequence of its `owner_leaf` (the lowest-id leaf below it),
with a node-level advantage; other leaves that pass through the node see its tokens as context only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

Stage = Literal["root", "bare", "expand"]

SUCCESS = 0.5  # the reward at or above which a leaf counts as a success (the one place it is set)


@dataclass
class Node:
    """One ReAct turn (or the prompt, for node 0).

    `action_ids` are the tokens the policy generated in this turn (trainable); `obs_ids` are the
    tokens the environment appended after it (masked everywhere). `reward` is set on terminal leaves
    only; `predicted` is the predictor's estimate of V(H_node) when it scored this prefix.
    `action_logprobs` are the engine's log-probabilities of the action tokens (empty when unknown),
    kept to check that engine and trainer agree.
    """

    id: int
    parent: int | None
    depth: int
    stage: Stage
    action_ids: list[int] = field(default_factory=list)
    obs_ids: list[int] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    reward: float | None = None
    predicted: float | None = None
    stop_reason: str | None = None
    action_logprobs: list[float] = field(default_factory=list)


@dataclass
class RolloutTree:
    """All rollouts of one prompt in one iteration."""

    task_id: int
    prompt_ids: list[int] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    # Environment state after each node (a snapshot), so a branch re-enters exactly that state.
    # Runtime only: not compared, not serialised (a resumed run rebuilds trees, it never branches old ones).
    env_states: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.nodes:
            self.nodes.append(Node(id=0, parent=None, depth=0, stage="root"))

    @property
    def root(self) -> Node:
        return self.nodes[0]

    def add_turn(
        self,
        parent: int,
        stage: Stage,
        action_ids: list[int],
        obs_ids: list[int],
        action_logprobs: list[float] | None = None,
    ) -> int:
        """Append a turn under `parent` and return its id."""
        if not 0 <= parent < len(self.nodes):
            raise IndexError(f"parent {parent} is not a node of tree {self.task_id}")
        if self.nodes[parent].reward is not None:
            raise ValueError(f"node {parent} is a terminal leaf; a terminal turn cannot be extended")
        if action_logprobs and len(action_logprobs) != len(action_ids):
            raise ValueError(f"{len(action_logprobs)} log-probs for {len(action_ids)} action tokens")
        node = Node(len(self.nodes), parent, self.nodes[parent].depth + 1, stage, action_ids, obs_ids)
        node.action_logprobs = list(action_logprobs or [])
        self.nodes.append(node)
        self.nodes[parent].children.append(node.id)
        return node.id

    def finish(self, node_id: int, reward: float, stop_reason: str) -> None:
        """Mark `node_id` as a terminal leaf with its reward."""
        node = self.nodes[node_id]
        if node.children:
            raise ValueError(f"node {node_id} has children; only a childless turn can end an episode")
        if node_id == 0:
            raise ValueError("the prompt itself cannot be a leaf: an episode has at least one turn")
        node.reward, node.stop_reason = float(reward), stop_reason

    def leaves(self) -> list[int]:
        return [n.id for n in self.nodes if n.reward is not None]

    def path(self, node_id: int) -> list[int]:
        """Node ids from the first turn down to `node_id` (the root is not included)."""
        out: list[int] = []
        cur: int | None = node_id
        while cur is not None and cur != 0:
            out.append(cur)
            cur = self.nodes[cur].parent
        return out[::-1]

    def token_ids(self, node_id: int) -> list[int]:
        """The full token sequence of prefix H_node: prompt, then every turn's action and observation."""
        ids = list(self.prompt_ids)
        for n in self.path(node_id):
            ids += self.nodes[n].action_ids + self.nodes[n].obs_ids
        return ids

    def parents(self) -> np.ndarray:
        """Parent index per node, -1 for the root.  # [n_nodes]"""
        return np.array([-1 if n.parent is None else n.parent for n in self.nodes], dtype=np.int64)

    def owner_leaf(self) -> np.ndarray:
        """For each node, the lowest-id leaf below it: the one sequence that trains its tokens."""
        owner = np.full(len(self.nodes), -1, dtype=np.int64)
        for n in reversed(self.nodes):
            if n.reward is not None:
                owner[n.id] = n.id
            elif n.children:
                owner[n.id] = min(int(owner[c]) for c in n.children)
        return owner

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "prompt_ids": self.prompt_ids,
            "nodes": [asdict(n) for n in self.nodes],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutTree:
        return cls(data["task_id"], list(data["prompt_ids"]), [Node(**n) for n in data["nodes"]])

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> RolloutTree:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class Backup:
    """Recursive backup over one tree (docs/algorithm.md#backup-node-values).  Arrays are [n_nodes].

    value[y]     = mean reward of the leaves in y's subtree (V̂; NaN where y has no leaf yet)
    leaves[y]    = number of leaves in y's subtree
    successes[y] = number of those leaves with reward >= threshold
    mixed[y]     = y's subtree holds at least one success and one failure
    """

    value: np.ndarray
    leaves: np.ndarray
    successes: np.ndarray
    mixed: np.ndarray


def backup(tree: RolloutTree, success_threshold: float = SUCCESS) -> Backup:
    """Bottom-up sums over the tree in one reverse pass (children always have larger ids)."""
    n = len(tree.nodes)
    reward_sum = np.zeros(n)
    leaves = np.zeros(n, dtype=np.int64)
    successes = np.zeros(n, dtype=np.int64)
    for node in reversed(tree.nodes):
        if node.reward is not None:
            reward_sum[node.id] += node.reward
            leaves[node.id] += 1
            successes[node.id] += int(node.reward >= success_threshold)
        if node.parent is not None:
            reward_sum[node.parent] += reward_sum[node.id]
            leaves[node.parent] += leaves[node.id]
            successes[node.parent] += successes[node.id]
    with np.errstate(invalid="ignore", divide="ignore"):
        value = np.where(leaves > 0, reward_sum / np.maximum(leaves, 1), np.nan)
    mixed = (successes > 0) & (successes < leaves)
    return Backup(value=value, leaves=leaves, successes=successes, mixed=mixed)


@dataclass(frozen=True)
class TreeStats:
    """Shape and contrast of one tree.

    `contrastive_pairs` counts leaf pairs with opposite outcomes (each pair has one anchor: the
    lowest common ancestor where their branches split); `prefix_contrastive_pairs` keeps the pairs
    whose anchor is a turn prefix (depth >= 1), i.e. contrast that TRACE Stage 2 can create.
    """

    leaves: int
    nodes: int
    depth: int
    branching: float  # mean number of children over internal nodes
    mixed: bool  # the prompt's tree has both outcomes (counts towards the effective ratio)
    mixed_by_depth: list[int]  # number of mixed nodes at each depth 0..depth
    leaves_by_stage: dict[str, int]
    contrastive_pairs: int
    prefix_contrastive_pairs: int


def tree_stats(tree: RolloutTree, success_threshold: float = SUCCESS) -> TreeStats:
    b = backup(tree, success_threshold)
    depths = np.array([n.depth for n in tree.nodes])
    internal = [len(n.children) for n in tree.nodes if n.children]
    leaf_ids = tree.leaves()
    by_stage: dict[str, int] = {"bare": 0, "expand": 0}
    for leaf in leaf_ids:  # a leaf ends a chain created by one stage, so it carries that stage
        by_stage[tree.nodes[leaf].stage] += 1
    pairs = prefix_pairs = 0
    for node in tree.nodes:  # pairs anchored at `node`: opposite outcomes in different children
        s = [int(b.successes[c]) for c in node.children]
        f = [int(b.leaves[c] - b.successes[c]) for c in node.children]
        anchored = sum(s) * sum(f) - sum(si * fi for si, fi in zip(s, f, strict=True))
        pairs += anchored
        prefix_pairs += anchored if node.depth >= 1 else 0
    max_depth = int(depths[leaf_ids].max()) if leaf_ids else 0
    return TreeStats(
        leaves=len(leaf_ids),
        nodes=len(tree.nodes),
        depth=max_depth,
        branching=float(np.mean(internal)) if internal else 0.0,
        mixed=bool(b.mixed[0]),
        mixed_by_depth=[int(b.mixed[depths == d].sum()) for d in range(max_depth + 1)],
        leaves_by_stage=by_stage,
        contrastive_pairs=pairs,
        prefix_contrastive_pairs=prefix_pairs,
    )


@dataclass(frozen=True)
class PredictorTargets:
    """Regression targets for the success predictor from one tree (docs/algorithm.md, "the joint path"
    in #predictor-targets-and-the-refit).

    Every node with at least one leaf below it is a target: the prompt (depth 0) and each turn
    prefix, with V̂ as the target and its leaf count as the optional weight. Leaves themselves are
    excluded: their prefix already contains the final answer, so V is their known reward.
    """

    node_ids: np.ndarray  # [K]
    values: np.ndarray  # [K] V̂, in [0, 1] for rewards in [0, 1]
    leaf_counts: np.ndarray  # [K]


def predictor_targets(tree: RolloutTree, success_threshold: float = SUCCESS) -> PredictorTargets:
    b = backup(tree, success_threshold)
    ids = np.array([n.id for n in tree.nodes if n.reward is None and b.leaves[n.id] > 0], dtype=np.int64)
    return PredictorTargets(node_ids=ids, values=b.value[ids], leaf_counts=b.leaves[ids])


def bare_outcomes(tree: RolloutTree) -> np.ndarray:
    """Success (0/1) of each bare rollout of a tree: unbiased draws of V(prompt)."""
    return np.array(
        [tree.nodes[x].reward >= SUCCESS for x in tree.leaves() if tree.nodes[x].stage == "bare"],  # type: ignore[operator]
        dtype=np.float64,
    )
