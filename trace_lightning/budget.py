"""What an iteration may spend and what it spent: the budget (leaves, or generated tokens), the ledger
that counts every stage's spend, and the plan that turns a token budget into this iteration's leaves.
See docs/algorithm.md#budget-rules and docs/configuration.md (`budget.*`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class BudgetError(ValueError):
    """A budget that cannot be met as configured. The message names the keys to change."""


@dataclass(frozen=True)
class Budget:
    """What one iteration may spend: leaves (trajectories) and, optionally, generated tokens.

    `unit="leaves"` (the default): every iteration spends exactly `leaves`, and `max_tokens`, when set,
    caps its generated tokens. `unit="tokens"`: the budget is `max_tokens` generated tokens, and the
    leaves are derived each iteration from what the run's own leaves cost (`leaves_for_tokens`), at
    most `leaves`; a method whose leaves are cheaper (continuations start mid-episode) gets more of
    them. Either way the runner never generates past `max_tokens`: it splits what is left between the
    live episodes every turn and ends the episodes that cannot have one more token (`token_budget`).
    """

    leaves: int = 12  # trajectories per iteration (unit=tokens: the most an iteration may spend)
    max_tokens: int | None = None  # cap on generated tokens per iteration (unit=tokens: the budget)
    unit: str = "leaves"  # what the budget counts: leaves, or generated tokens (max_tokens)

    def __post_init__(self) -> None:
        if self.leaves < 1:
            raise BudgetError(f"budget.leaves={self.leaves}: an iteration needs at least one rollout")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise BudgetError(f"budget.max_tokens={self.max_tokens}: use null for no token cap, or >= 1")
        if self.unit not in ("leaves", "tokens"):
            raise BudgetError(f"budget.unit={self.unit!r} must be 'leaves' or 'tokens'")
        if self.unit == "tokens" and self.max_tokens is None:
            raise BudgetError(
                "budget.unit=tokens needs budget.max_tokens: the generated tokens each iteration may spend"
            )


TOKEN_HEADROOM = 0.9  # budget.unit=tokens plans its leaves to spend this share of max_tokens


def leaves_for_tokens(budget: Budget, previous: tuple[int, int, bool] | None, step: int, least: int) -> int:
    """The leaves of the next iteration under `budget.unit="tokens"`.

    `previous` is the last iteration's (leaves, generated tokens, whether the token budget bound it:
    cut an episode, or held a turn below `sampling.max_new_tokens`), None before the first. Without a
    measurement: half of `budget.leaves`, so that the first cost is measured with the budget unlikely
    to bind (a binding budget shortens every running episode's turn). After a bound iteration: one
    `step` fewer than last time, since its token count is what the budget allowed, not what the leaves
    would have cost.
    Otherwise the most leaves whose cost at the last iteration's tokens per leaf fits `TOKEN_HEADROOM`
    of `max_tokens`: the leaves of one iteration are sampled together, so when the budget runs out it
    cuts every episode still running, and the headroom keeps that rare.
    Always a multiple of `step` (what the allocator can split), within [`least`, `budget.leaves`].

    Example: max_tokens 1200, last iteration 24 leaves for 800 tokens (33.3 each), step 3 ->
    1080 / 33.3 = 32.4 -> 30."""
    assert budget.max_tokens is not None
    if previous is None:
        fit = budget.leaves // 2
    else:
        leaves, tokens, cut = previous
        fit = leaves - step if cut else int(TOKEN_HEADROOM * budget.max_tokens * leaves // max(tokens, 1))
    fit = fit // step * step
    return max(least, min(budget.leaves // step * step, fit))


class BudgetExceeded(RuntimeError):
    """Raised when a stage asks for more than the budget holds: a bug in the caller, never expected."""


@dataclass
class BudgetLedger:
    """The one object that counts what an iteration spends, per stage and per depth."""

    budget: Budget
    leaves: dict[str, int] = field(default_factory=lambda: {"bare": 0, "expand": 0})
    tokens: dict[str, int] = field(default_factory=lambda: {"bare": 0, "expand": 0})
    tokens_by_depth: dict[int, int] = field(default_factory=dict)
    returned: int = 0  # leaves priced Stage 2 gave back to Stage 1 (spent as root groups, counted "bare")

    @property
    def leaves_used(self) -> int:
        return sum(self.leaves.values())

    @property
    def tokens_used(self) -> int:
        return sum(self.tokens.values())

    def reserve_leaves(self, n: int, stage: str) -> None:
        if self.leaves_used + n > self.budget.leaves:
            raise BudgetExceeded(f"{stage} asked for {n} leaves with {self.leaves_left()} left")
        self.leaves[stage] += n

    def leaves_left(self) -> int:
        return self.budget.leaves - self.leaves_used

    def tokens_left(self) -> int | None:
        return None if self.budget.max_tokens is None else self.budget.max_tokens - self.tokens_used

    def charge_tokens(self, n: int, stage: str, depth: int) -> None:
        left = self.tokens_left()
        if left is not None and n > left:
            raise BudgetExceeded(f"{stage} generated {n} tokens with {left} left in budget.max_tokens")
        self.tokens[stage] += n
        self.tokens_by_depth[depth] = self.tokens_by_depth.get(depth, 0) + n


def plan_leaves(
    budget: Budget,
    previous: tuple[int, int, bool] | None,
    step: int,
    least: int,
    can_spend: Callable[[int], bool],
) -> Budget:
    """This iteration's budget: `budget` itself, or under `budget.unit="tokens"` a leaf budget of the
    leaves `leaves_for_tokens` derives, lowered by `step` while the allocator cannot spend them exactly
    (`can_spend`, e.g. `TreeAllocator.can_spend` over the pool), never below `least`."""
    if budget.unit != "tokens":
        return budget
    leaves = leaves_for_tokens(budget, previous, step, least)
    while leaves > least and not can_spend(leaves):  # e.g. Stage 1's groups all of one size
        leaves -= step
    return Budget(leaves, budget.max_tokens)
