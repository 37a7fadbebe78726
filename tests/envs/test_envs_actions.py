import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_lightning.envs.actions import MAX_ARGUMENT_CHARS, Action, ActionError, parse_action

ALLOWED = ("search", "answer")


def test_thought_then_action():
    assert parse_action("K2 is tall. <search>K2 height</search>", ALLOWED) == Action("search", "K2 height")
    assert parse_action("<answer>\n 8,611 m \n</answer>", ALLOWED) == Action("answer", "8,611 m")


def test_first_complete_allowed_tag_wins():
    assert parse_action("<search>a</search> <answer>b</answer>", ALLOWED) == Action("search", "a")
    # an unclosed tag before a complete one is skipped: the complete one is the action
    assert parse_action("<search>a <answer>b</answer>", ALLOWED) == Action("answer", "b")
    # tags the env does not offer are ignored when an allowed one is present
    assert parse_action("<calculate>1+1</calculate> <answer>2</answer>", ALLOWED) == Action("answer", "2")


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("I think the answer is 72.", "no action found"),
        ("<foo>x</foo>", "unknown action <foo>"),
        ("<Search>K2</Search>", "unknown action <Search>"),
        ("<answer>72", "end the action with </answer>"),
        ("72</answer>", "no opening <answer>"),
        ("<search>   </search>", "is empty"),
        ("<search>" + "x" * (MAX_ARGUMENT_CHARS + 1) + "</search>", "keep it under"),
        ("", "no action found"),
    ],
)
def test_errors_tell_the_model_what_to_write(text, hint):
    result = parse_action(text, ALLOWED)
    assert isinstance(result, ActionError)
    assert hint in result.message


def test_error_lists_the_allowed_forms():
    result = parse_action("<foo>x</foo>", ALLOWED)
    assert isinstance(result, ActionError)
    assert "<search>...</search>" in result.message and "<answer>...</answer>" in result.message


def test_argument_at_the_length_limit_is_accepted():
    assert parse_action("<answer>" + "x" * MAX_ARGUMENT_CHARS + "</answer>", ALLOWED) == Action(
        "answer", "x" * MAX_ARGUMENT_CHARS
    )


def test_bad_allowed_names_are_a_programming_error():
    with pytest.raises(ValueError, match="lowercase identifiers"):
        parse_action("x", ["<search>"])


TAG_SOUP = st.lists(
    st.sampled_from(
        ["<search>", "</search>", "<answer>", "</answer>", "<foo>", "</foo>", "<", ">", "/", "x", " "]
    ),
    max_size=30,
).map("".join)


@given(st.text() | TAG_SOUP)
def test_any_text_parses_without_raising(text):
    result = parse_action(text, ALLOWED)
    assert isinstance(result, Action | ActionError)
    if isinstance(result, Action):
        assert result.name in ALLOWED and result.argument and len(result.argument) <= MAX_ARGUMENT_CHARS


@given(
    st.sampled_from(ALLOWED),
    st.text().filter(lambda t: "<" not in t),
    st.text(max_size=MAX_ARGUMENT_CHARS).filter(lambda a: a.strip() and "<" not in a),
)
def test_valid_tag_round_trips(name, thought, argument):
    assert parse_action(f"{thought}<{name}>{argument}</{name}>", ALLOWED) == Action(name, argument.strip())
