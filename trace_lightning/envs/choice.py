"""One turn of a letter-choosing task (`chain`, `decisive`): the shared rules of `<choose>letter</choose>`.

State is `(turn, mistakes)`. A pick outside `letters` (or no parseable action) is a format error that
leaves the state unchanged; a wrong pick is a mistake; the episode is lost once mistakes exceed the
tolerance and solved when every turn is done within it.
"""

from __future__ import annotations

from collections.abc import Callable

from trace_lightning.envs.actions import ActionError, parse_action
from trace_lightning.envs.base import Transition


def choose_step(
    action_text: str,
    state: tuple[int, int],
    letters: str,
    answer: str,
    tolerance: int,
    turns: int,
    not_a_letter: Callable[[str], str],
    observe: Callable[[bool, int], str],
) -> Transition:
    """`answer` is the right letter for this turn; `not_a_letter(argument)` words the format error;
    `observe(right, next_turn)` is the observation text when the episode goes on."""
    turn, mistakes = state
    action = parse_action(action_text, ("choose",))
    if not isinstance(action, ActionError) and action.argument.upper() not in tuple(letters):
        action = ActionError(not_a_letter(action.argument[:20]))
    if isinstance(action, ActionError):
        return Transition(
            f"<observation>error: {action.message}</observation>", False, None, None, state, format_error=True
        )
    right = action.argument.upper() == answer
    turn, mistakes = turn + 1, mistakes + (not right)
    if mistakes > tolerance:
        return Transition("", True, 0.0, "lost", (turn, mistakes), tool="choose")
    if turn == turns:
        return Transition("", True, 1.0, "solved", (turn, mistakes), tool="choose")
    return Transition(
        f"<observation>{observe(right, turn)}</observation>",
        False,
        None,
        None,
        (turn, mistakes),
        tool="choose",
    )
