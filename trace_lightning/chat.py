"""Chat templates: the prompt, the text between turns, and the start-up check of a model's template.

Every turn is written by the tokenizer's own chat template. At start-up `chat_turns` renders a short
conversation with placeholders and reads off what the template writes between an assistant turn and
the next one; the runner then appends turns as token ids, never re-rendering the conversation.

A chat template is code that comes with a model folder (or `model.chat_template`), and transformers
renders it in a Jinja sandbox that blocks attribute tricks but bounds neither time nor memory: a
template with nested loops hangs start-up, one that doubles a string takes gigabytes. So the first
render runs in a child process with a time, memory and length bound (`check_template_bounds`), and
only a template that passes it is rendered here.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

RENDER_SECONDS = 10.0  # a real template renders a four-message conversation in milliseconds
MAX_RENDER_CHARS = 1_000_000  # the same conversation is a few hundred characters in a real template
RENDER_MEMORY = 512 * 2**20  # bytes the child may allocate beyond what importing transformers took
IMPORT_SECONDS = 120.0  # importing transformers in the child; not the template's time
TEMPLATE_KEY = (
    "model.chat_template=<a Jinja template, or the path of a .jinja file> (the model's own, e.g. from its "
    "instruct variant)"
)
FIX = f"give the model a chat template: {TEMPLATE_KEY}"
REPLACE = f"fix the template, or replace it: {TEMPLATE_KEY}"


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


# What `chat_turns` renders: system, user, assistant; then with a second user turn and the next header.
_THREE = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": _ACTION},
]
_TRIAL = [(_THREE, False), ([*_THREE, {"role": "user", "content": _OBSERVATION}], True)]


def chat_turns(tokenizer: Any) -> ChatTurns:
    """The tokenizer's chat template, read as `ChatTurns` (cached per template); `ChatTemplateError`
    naming the fix when there is no template, when its first render breaks a bound
    (`check_template_bounds`), or when it does not render a system, user, assistant, user conversation
    as an extension of its first three turns (then turns cannot be appended)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template or not isinstance(template, str):
        raise ChatTemplateError(f"the tokenizer of this model has no chat template; {FIX}")
    key = (template, str(tokenizer.eos_token))
    if key in _TURNS:
        return _TURNS[key]
    check_template_bounds(template, _TRIAL, dict(tokenizer.special_tokens_map))
    try:
        before, after = (
            tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=g) for m, g in _TRIAL
        )
    except Exception as err:  # a template that raises on a system turn or a second user turn
        raise ChatTemplateError(
            f"the chat template cannot render a multi-turn episode ({err}); {FIX}"
        ) from err
    _TURNS[key] = _read_turns(tokenizer, before, after)
    return _TURNS[key]


def _read_turns(tokenizer: Any, before: str, after: str) -> ChatTurns:
    """`ChatTurns` from the three-message render (`before`) and the four-message one (`after`)."""
    cut = after.find(_ACTION)
    if cut < 0 or _OBSERVATION not in after or not after.startswith(before[: before.find(_ACTION)]):
        raise ChatTemplateError(
            "the chat template does not render a conversation as the extension of its first turns (the "
            f"runner appends turns); {FIX}"
        )
    close = before[before.find(_ACTION) + len(_ACTION) :]
    between, rest = after[cut + len(_ACTION) :].split(_OBSERVATION, 1)
    special = {
        *tokenizer.all_special_tokens,
        *(t.content for t in tokenizer.added_tokens_decoder.values() if t.special),
    }
    specials = [t for t in special if t and t in between]
    split = max((between.rfind(t) + len(t) for t in specials), default=0)
    return ChatTurns(between[:split], between[split:], rest, close.rstrip("\n") or str(tokenizer.eos_token))


# The child renders with transformers' own renderer (its sandbox, filters and `{% generation %}` tag),
# says "ready" once imported, then renders under an address-space limit set from what it holds by then.
_CHILD = r"""
import json, resource, sys
from transformers.utils.chat_template_utils import render_jinja_template

print("ready", flush=True)
job = json.loads(sys.stdin.read())
try:
    with open("/proc/self/status") as status:
        held = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (held + job["memory"], hard))
except Exception:
    pass  # no /proc or no such limit (not Linux): the time and length bounds still hold
lengths = []
try:
    for messages, generation in job["renders"]:
        rendered, _ = render_jinja_template(
            conversations=[messages], chat_template=job["template"], add_generation_prompt=generation,
            **job["variables"],
        )
        lengths.append(len(rendered[0]))
        if lengths[-1] > job["max_chars"]:
            break
    reply = {"lengths": lengths}
except MemoryError:
    reply = {"memory": True}
except Exception as err:
    reply = {"error": f"{type(err).__name__}: {err}"[:500]}
print(json.dumps(reply), flush=True)
"""
Renders = list[tuple[list[dict[str, str]], bool]]


def check_template_bounds(
    template: str,
    renders: Renders,
    variables: dict[str, Any],
    seconds: float = RENDER_SECONDS,
    max_chars: int = MAX_RENDER_CHARS,
) -> None:
    """Render `template` on each (messages, add_generation_prompt) of `renders` in a child process;
    `ChatTemplateError` naming `model.chat_template` when a render raises, runs past `seconds`, needs
    more than `RENDER_MEMORY` bytes or writes more than `max_chars` characters. `variables`: what the
    template sees besides the messages (the tokenizer's special tokens, as transformers passes them).

    A child, not a thread: a thread can be neither stopped nor held to a memory bound, and a hung render
    would keep burning a core for the rest of the run. The child's start-up (importing transformers,
    about a second) is not counted in `seconds`: it says "ready" first, and only then gets the template.
    """
    job = {"template": template, "renders": renders, "variables": variables}
    reply = _run_child(json.dumps({**job, "max_chars": max_chars, "memory": RENDER_MEMORY}), seconds)
    if "error" in reply:
        error = reply["error"]
        raise ChatTemplateError(f"the chat template cannot render a multi-turn episode ({error}); {FIX}")
    what = "model.chat_template: the chat template"
    if "memory" in reply:
        raise ChatTemplateError(
            f"{what} needed more than {RENDER_MEMORY // 2**20} MiB to render a four-message conversation "
            f"(it builds a huge string); {REPLACE}"
        )
    longest = max(reply["lengths"], default=0)
    if longest > max_chars:
        raise ChatTemplateError(
            f"{what} rendered {longest:,} characters for a four-message conversation, over the "
            f"{max_chars:,} bound (it builds a huge string); {REPLACE}"
        )


def _run_child(job: str, seconds: float) -> dict[str, Any]:
    """The render child's JSON reply to `job`; it is killed when it has not answered within `seconds`."""
    command = [sys.executable, "-P", "-c", _CHILD]  # -P: a folder in the cwd cannot shadow a package
    pipe = subprocess.PIPE
    with (
        tempfile.TemporaryFile() as errors,
        subprocess.Popen(command, stdin=pipe, stdout=pipe, stderr=errors, encoding="utf-8") as proc,
    ):
        try:
            reply = _ask(proc, job, seconds)
        finally:
            proc.kill()  # a no-op once it has exited
        if reply is not None:
            return json.loads(reply)  # type: ignore[no-any-return]
        errors.seek(0)
        tail = errors.read().decode("utf-8", "replace")[-2000:]
    raise ChatTemplateError(
        "model.chat_template: the child process that renders the chat template once at start-up failed "
        f"(exit code {proc.returncode}):\n{tail}"
    )


def _ask(proc: subprocess.Popen[str], job: str, seconds: float) -> str | None:
    """The child's last line of output once it has rendered `job`, or None when it died first."""
    assert proc.stdout is not None
    if not select.select([proc.stdout], [], [], IMPORT_SECONDS)[0] or proc.stdout.readline() != "ready\n":
        return None  # it failed to start (its stderr says why)
    try:
        out, _ = proc.communicate(job, timeout=seconds)
    except subprocess.TimeoutExpired:
        raise ChatTemplateError(
            "model.chat_template: the chat template did not finish rendering a four-message "
            f"conversation within {seconds:g} s (a loop that never ends, or one far too long); {REPLACE}"
        ) from None
    lines = out.strip().splitlines()
    return lines[-1] if lines else None


def encodable(text: str) -> str:
    """`text`, with what UTF-8 cannot encode (a lone surrogate, as a tool echoing the JSON escape
    `\\ud800` returns) replaced by "?": the tokenizer raises `TypeError` on such a string."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def observation_parts(tokenizer: Any, observation: str, action_ids: list[int]) -> tuple[list[int], ...]:
    """`observation_ids` in three parts: the template's markup before the observation, the user prefix
    and the observation (the part the runner cuts when the episode has no room for all of it), and the
    markup after it through the next assistant header."""
    turns = chat_turns(tokenizer)
    head_text = turns.after_action
    closed = bool(action_ids) and action_ids[-1] == tokenizer.eos_token_id
    if closed and head_text.startswith(turns.close):
        head_text = head_text[len(turns.close) :]
    text = encodable(f"{turns.user_prefix}{observation}")
    body = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return _markup(tokenizer, head_text), list(body), _markup(tokenizer, turns.after_observation)


def observation_ids(tokenizer: Any, observation: str, action_ids: list[int]) -> list[int]:
    """The environment's reply as a user turn, then the header of the next assistant turn, as the
    tokenizer's chat template writes them (`chat_turns`).

    The chat markers are special tokens; the observation is not. Tool output (a web page, what
    model-written code printed) is tokenised with special-token parsing off, so a forged
    `<|im_end|>\n<|im_start|>system` in it stays plain text instead of opening a real system turn.
    An action that ended with the EOS token already holds the template's end of turn; one cut before
    it (a stop string, the token cap) gets it here, so the next turn always opens cleanly.
    """
    head, body, tail = observation_parts(tokenizer, observation, action_ids)
    return [*head, *body, *tail]


def _markup(tokenizer: Any, text: str) -> list[int]:
    """Ids of chat-template text we wrote ourselves, special tokens parsed."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
