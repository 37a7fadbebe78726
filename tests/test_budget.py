"""The budget's one owner (budget.py): the token plan, and what an allocator can spend exactly."""

import pytest

from trace_lightning import allocation as alloc
from trace_lightning.budget import Budget, BudgetExceeded, BudgetLedger, leaves_for_tokens, plan_leaves


def test_a_leaf_budget_is_its_own_plan():
    budget = Budget(48)
    assert plan_leaves(budget, (10, 10_000, True), 4, 4, lambda n: False) is budget


def test_the_token_plan_steps_down_to_what_the_allocator_can_spend():
    """1200 tokens, last 24 leaves for 800: 0.9 * 1200 * 24 / 800 = 32.4 -> 30 by steps of 3, then
    down by 3 while `can_spend` says no (here: only multiples of 4 below 30 -> 24)."""
    budget = Budget(60, 1200, "tokens")
    plan = plan_leaves(budget, (24, 800, False), 3, 3, lambda n: n % 4 == 0)
    assert (plan.leaves, plan.max_tokens, plan.unit) == (24, 1200, "leaves")
    assert plan_leaves(budget, (24, 800, False), 3, 27, lambda n: False).leaves == 27  # never below least


def test_allocators_say_what_they_can_spend_over_a_pool():
    grpo = alloc.uniform(4)
    assert grpo.can_spend(8, pool_size=2) and not grpo.can_spend(10, pool_size=8)
    assert not grpo.can_spend(12, pool_size=2)  # three groups need three prompts
    spread = alloc.trace(2, group_size=4, pricing=alloc.Pricing())
    assert spread.can_spend(21, pool_size=8) and not spread.can_spend(22, pool_size=8)  # 1 + N = 3
    assert spread.can_spend(22, pool_size=8, steer=False)  # closed: every leaf a bare rollout


def test_a_closed_gate_splits_token_budgets_into_grpos_groups():
    """Open, trace splits by 1 + N; closed, it is GRPO and splits by GRPO's group size, as uniform does."""
    trace = alloc.trace(2, group_size=4, pricing=alloc.Pricing())
    assert trace.leaf_step(steer=True) == 3
    assert trace.leaf_step(steer=False) == alloc.uniform(4).leaf_step() == 4
    ungated = alloc.trace(2)  # no closed rule: the gate changes nothing
    assert ungated.leaf_step(steer=False) == ungated.leaf_step(steer=True)


def test_ledger_refuses_overspending():
    ledger = BudgetLedger(Budget(leaves=4, max_tokens=10))
    ledger.reserve_leaves(3, "bare")
    with pytest.raises(BudgetExceeded):
        ledger.reserve_leaves(2, "expand")
    ledger.charge_tokens(10, "bare", 1)
    assert ledger.tokens_left() == 0
    with pytest.raises(BudgetExceeded):
        ledger.charge_tokens(1, "expand", 2)


def test_leaves_for_tokens_by_hand():
    """budget.unit=tokens: worked by hand from the rule (90% of max_tokens at the last cost per leaf)."""
    budget = Budget(48, 1200, "tokens")
    assert leaves_for_tokens(budget, None, 3, 3) == 24  # nothing measured: half of budget.leaves
    assert leaves_for_tokens(budget, (24, 800, False), 3, 3) == 30  # 1080 / (800 / 24) = 32.4
    assert leaves_for_tokens(budget, (24, 1200, True), 3, 3) == 21  # bound: one step fewer
    assert leaves_for_tokens(budget, (24, 100, False), 3, 3) == 48  # cheap leaves: at most 48
    assert leaves_for_tokens(budget, (48, 12000, False), 3, 6) == 6  # dear leaves: at least 6
    assert leaves_for_tokens(Budget(50, 1200, "tokens"), None, 4, 4) == 24  # a multiple of 4
