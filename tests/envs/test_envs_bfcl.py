"""env=bfcl: BFCL v4 multi-turn entries as episodes (data, call format, what may be called, replay, the
checker, the split). Expectations are written from BFCL's documented semantics and the entries' data,
on small real entries: base_100 (TradingBot: get_stock_info NVDA, then fund_account 2203.4), base_139
(TradingBot: add ZETA to the watchlist, then show the watchlist), base_11 (ls, then a tweet of its
result), and their miss_param / miss_func versions."""

import importlib.util
import json

import numpy as np
import pytest

from trace_lightning.budget import Budget, BudgetLedger
from trace_lightning.engines.base import Completion, EngineStats, SamplingParams
from trace_lightning.envs.base import split_tasks
from trace_lightning.envs.bfcl.checker import call_overlap, compare_states, missing_results
from trace_lightning.envs.bfcl.data import SUBSETS, Call, CallSyntaxError, load_entries, parse_call_string
from trace_lightning.envs.bfcl.env import BFCLEnv, BFCLState, Malformed, Reply, call_text, parse_move
from trace_lightning.envs.bfcl.prompt import docs_for, system_prompt
from trace_lightning.envs.bfcl.world import Replay, owners, shown

# bfcl-eval ships with `make install` (DATA_PACKAGES); the modules above import it only when used
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bfcl_eval") is None, reason="bfcl-eval is not installed: run `make install`"
)


def call(name, **kwargs) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": kwargs}) + "</tool_call>"


def play(env, number, actions):
    """Step `actions` from the start of entry `number`; every transition."""
    task = next(t for t in env.tasks() if t.task_id == number)
    state, out = env.initial_state(task), []
    for action in actions:
        tr = env.step(task, state, action)
        out.append(tr)
        state = tr.state
    return out


@pytest.fixture(scope="module")
def base():
    return BFCLEnv("base")


# ----------------------------------------------------------------------------------------------- data


def test_four_subsets_of_200_entries_with_ground_truth_per_turn():
    for subset in SUBSETS:
        entries = load_entries(subset)
        assert len(entries) == 200 and len({e.number for e in entries}) == 200
        assert all(len(e.ground_truth) == len(e.turns) and e.turns[0] for e in entries)
    base_100 = next(e for e in load_entries("base") if e.number == 100)
    assert base_100.classes == ("TradingBot",) and len(base_100.turns) == 2
    assert base_100.ground_truth[1] == (Call.make("fund_account", {"amount": 2203.4}),)
    # miss_func_100 reveals get_stock_info at turn 1, whose user message is empty
    miss = next(e for e in load_entries("miss_func") if e.number == 100)
    assert miss.missed == ((1, ("get_stock_info",)),) and miss.turns[1] == ""
    assert next(e for e in load_entries("long_context") if e.number == 100).long_context


def test_ground_truth_strings_are_parsed_as_literals_only():
    assert parse_call_string("sort('final_report.pdf')") == Call.make("sort", {}, ["final_report.pdf"])
    assert parse_call_string("mv(source='a', destination='b')").values() == (
        [],
        {"source": "a", "destination": "b"},
    )
    for bad in (
        "os.system('x')",
        "f(x=open('a'))",
        "f(*a)",
        "f(**k)",
        "f(x=1+1)",
        "f(x={1, 2})",
        "import os",
        "f(",
    ):
        with pytest.raises(CallSyntaxError):
            parse_call_string(bad)


# ------------------------------------------------------------------------------------------ format


def test_a_turn_is_one_json_call_or_a_reply():
    move = parse_move('I will check. <tool_call>{"name": "ls", "arguments": {"a": true}}</tool_call>')
    assert move == Call.make("ls", {"a": True})
    assert parse_move("All done, the files are listed.") == Reply("All done, the files are listed.")
    assert parse_move('{"name": "ls"}') == Reply('{"name": "ls"}')  # untagged JSON is text, not a call
    assert isinstance(parse_move('<tool_call>{"name": "ls"'), Malformed)  # not closed
    assert parse_move('<tool_call>{"name": "ls"}</tool_call>') == Call.make("ls", {})  # arguments optional
    for body in (
        "ls(a=True)",
        "[1]",
        '{"name": 3}',
        '{"name": "os.system", "arguments": {}}',
        '{"name": "__import__(\'os\')"}',
        '{"name": "ls", "arguments": [1]}',
        "[" * 100_000,
    ):
        assert isinstance(parse_move(f"<tool_call>{body}</tool_call>"), Malformed), body


def test_prompt_lists_the_docs_in_our_format_where_the_template_has_no_tools():
    from trace_lightning.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    lean, rich = BFCLEnv("base", max_doc_chars=5000), BFCLEnv("base", max_doc_chars=40000)
    task = next(t for t in lean.tasks() if t.task_id == 100)
    assert (lean.levels[100], rich.levels[100]) == ("signatures", "full")
    text = tok.decode(lean.prompt_ids(task, tok))
    assert "Functions:\n# TradingBot:" in text and "fund_account(amount: float) - " in text
    assert '"response"' in tok.decode(rich.prompt_ids(task, tok))  # full docs keep the response schema
    assert text.rstrip().endswith("assistant") and task.question in text
    # every entry's system prompt fits the budget (the level is chosen per entry)
    for number, entry in lean.entries.items():
        assert len(system_prompt(docs_for(list(shown(entry, 0).items())), lean.levels[number])) <= 5000


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0]['content'] }}\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Return each call as JSON within <tool_call></tool_call> tags.<|im_end|>\n"
    "{% for m in messages[1:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% else %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_a_tool_format_gets_the_docs_as_tools():
    from trace_lightning.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    env = BFCLEnv("base", max_doc_chars=5000)
    text = tok.decode(env.prompt_ids(next(t for t in env.tasks() if t.task_id == 100), tok))
    assert "<tools>" in text and '"name": "fund_account"' in text and "Functions:" not in text
    assert '"amount": {"type": "number"}' in text  # BFCL's float as JSON schema's number


# ------------------------------------------------------------------------------ what may be called


def test_only_documented_functions_of_the_entry_run_and_errors_are_observations(base):
    before = BFCLState("multi_turn_base_100")
    rejected = [
        call("_load_scenario", scenario={}),  # private
        call("__init__"),  # dunder
        call("__class__"),
        call("ls"),  # a GorillaFileSystem function: not this entry's class
        call("fund_acount", amount=1),  # misspelt
        '<tool_call>{"name": "fund_account", "arguments": {"amount": 1}</tool_call>',  # bad JSON
    ]
    for action in rejected:
        tr = play(base, 100, [action])[0]
        assert not tr.done and tr.observation.startswith("<tool_response>\nError: ")
        assert tr.state.calls == before.calls and tr.state.steps == 1  # nothing ran; the attempt counts
    bad_argument = play(base, 100, [call("fund_account", amout=5)])[0]  # runs, raises TypeError inside
    assert bad_argument.tool_error and "Error during execution: " in bad_argument.observation
    assert bad_argument.state.calls == (Call.make("fund_account", {"amout": 5}),)
    ok = play(base, 100, ["Let me look. " + call("get_stock_info", symbol="NVDA")])[0]
    assert not ok.tool_error and '"price": ' in ok.observation and ok.tool == "get_stock_info"
    assert base.entries[0].excluded == {"cp"} and "cp" not in owners(base.entries[0])
    assert (
        "Error: 'cp' is not an available function"
        in play(base, 0, [call("cp", source="a", destination="b")])[0].observation
    )


def test_a_turn_with_one_attempt_too_many_ends_the_episode_as_bfcl_force_quits():
    env = BFCLEnv("base", max_calls_per_turn=2)
    steps = play(env, 100, [call("get_stock_info", symbol="NVDA")] * 2 + [call("get_current_time")])
    assert [t.done for t in steps] == [False, False, True]
    assert (steps[-1].reward, steps[-1].stop_reason) == (0.0, "call_cap")
    # a reply resets the count: the next user turn gets the full cap again
    ok = play(
        env, 100, [call("get_stock_info", symbol="NVDA")] * 2 + ["Done.", call("fund_account", amount=2203.4)]
    )
    assert not ok[-1].done and ok[-1].state.steps == 1 and ok[-1].state.turn == 1


# ------------------------------------------------------------------------------------------ replay


def test_replaying_a_prefix_twice_gives_equal_but_separate_instances(base):
    entry = base.entries[11]  # GorillaFileSystem + TwitterAPI
    prefix = (Call.make("cd", {"folder": "temp"}), Call.make("touch", {"file_name": "x.txt"}))
    replay = Replay(max_items=1)  # nearly no cache: the second replay rebuilds from scratch
    first, results = replay.after(entry, prefix)
    replay.after(entry, ())  # evicts the prefix
    second, again = replay.after(entry, prefix)
    assert (
        results == again
        and first is not second
        and first["GorillaFileSystem"] is not second["GorillaFileSystem"]
    )
    equal, total, differing = compare_states(first, second)
    assert total > 0 and equal == total and differing == ()
    first["GorillaFileSystem"].root.contents.clear()  # mutating one copy changes no later replay
    assert compare_states(replay.after(entry, prefix)[0], second)[2] == ()


def test_a_continuation_never_sees_a_siblings_calls(base):
    task = next(t for t in base.tasks() if t.task_id == 11)
    parent = base.step(task, base.initial_state(task), call("cd", folder="temp")).state
    left = base.step(task, parent, call("mkdir", dir_name="sibling_dir")).state
    right = base.step(task, parent, call("ls"))
    assert "sibling_dir" not in right.observation and "file1.txt" in right.observation
    assert right.state.calls == (*parent.calls, Call.make("ls", {}))
    assert "sibling_dir" in base.step(task, left, call("ls")).observation  # the left branch has it


# ----------------------------------------------------------------------------------------- checker


def test_compare_states_and_missing_results_by_hand():
    class Box:
        def __init__(self, a, b):
            self.a, self.b, self._private = a, b, object()  # private attributes are never compared

    assert compare_states({"X": Box(1, [2])}, {"X": Box(1, [2])}) == (2, 2, ())
    assert compare_states({"X": Box(1, [3])}, {"X": Box(1, [2])}) == (1, 2, ("X.b",))
    assert missing_results(["a", "a", "b"], ["b", "a", "c"]) == ("a",)  # each produced result used once
    assert missing_results(["b", "a"], ["a", "b"]) == ()  # order is not enforced


def verdicts(trs):
    return [(v.turn, v.passed) for v in trs[-1].state.verdicts]


def test_the_ground_truth_itself_passes_every_subset():
    for subset, number, actions in [
        (
            "base",
            100,
            [call("get_stock_info", symbol="NVDA"), "Done.", call("fund_account", amount=2203.4), "Done."],
        ),
        (
            "miss_param",
            100,
            [
                "Which company?",
                call("get_stock_info", symbol="NVDA"),
                "ok",
                call("fund_account", amount=2203.4),
                "ok",
            ],
        ),
        (
            "miss_func",
            100,
            [
                "I cannot.",
                call("get_stock_info", symbol="NVDA"),
                "ok",
                call("fund_account", amount=2203.4),
                "ok",
            ],
        ),
        (
            "long_context",
            100,
            [call("get_stock_info", symbol="NVDA"), "ok", call("fund_account", amount=2203.4), "ok"],
        ),
    ]:
        trs = play(BFCLEnv(subset), number, actions)
        assert (trs[-1].done, trs[-1].reward, trs[-1].stop_reason) == (True, 1.0, "end"), subset
        assert all(passed for _, passed in verdicts(trs))


def test_planted_mistakes_fail_where_bfcl_fails_them(base):
    nvda, fund = call("get_stock_info", symbol="NVDA"), call("fund_account", amount=2203.4)
    wrong_amount = play(base, 100, [nvda, "Done.", call("fund_account", amount=2000), "Done."])
    assert wrong_amount[-1].reward == 0.0 and verdicts(wrong_amount) == [(0, True), (1, False)]
    v = wrong_amount[-1].state.verdicts[1]
    assert not v.state_ok and not v.response_ok  # the balance differs, and so does the call's result
    no_call = play(base, 100, ["NVDA looks fine.", fund, "Done."])  # turn 0 needs a call: none made
    assert verdicts(no_call) == [(0, False), (1, True)] and not no_call[-1].state.verdicts[0].called
    early = play(base, 100, [nvda, fund, "Done.", "Done."])  # funding in turn 0: the state is ahead of BFCL's
    assert verdicts(early)[0] == (0, False) and early[-1].reward == 0.0
    stopped = play(base, 100, [nvda, "Done."])  # the conversation is not over: no reward yet
    assert not stopped[-1].done


def test_extra_calls_and_results_from_earlier_turns_count_as_bfcl_counts_them(base):
    extra = play(
        base,
        100,
        [
            call("get_stock_info", symbol="AAPL"),
            call("get_stock_info", symbol="NVDA"),
            "Done.",
            call("fund_account", amount=2203.4),
            "Done.",
        ],
    )
    assert extra[-1].reward == 1.0  # a read-only extra call changes no state, and results need only be found
    # base_139 turn 1's ground truth is get_watchlist(); its result was already produced in turn 0
    ahead = play(
        base,
        139,
        [
            call("add_to_watchlist", stock="ZETA"),
            call("get_watchlist"),
            "Done.",
            call("get_current_time"),
            "Here is your watchlist.",
        ],
    )
    assert ahead[-1].reward == 1.0 and verdicts(ahead) == [(0, True), (1, True)]


def test_miss_param_turn_is_not_checked_and_miss_func_reveals_the_doc():
    # miss_param_100: turn 0 lacks the company; a read call there is not checked, and counts later
    trs = play(
        BFCLEnv("miss_param"),
        100,
        [
            "Which company do you mean?",
            call("get_stock_info", symbol="NVDA"),
            "ok",
            call("fund_account", amount=2203.4),
            "ok",
        ],
    )
    assert trs[-1].reward == 1.0 and not trs[-1].state.verdicts[0].checked
    assert trs[0].observation == BFCLEnv("miss_param").entries[100].turns[1]  # the next user message
    env = BFCLEnv("miss_func", max_doc_chars=5000)
    task = next(t for t in env.tasks() if t.task_id == 100)
    shown_first = "".join(map(chr, env.prompt_ids(task, _Chars())))
    assert env.levels[100] == "compact"  # one class: its compact docs fit 5,000 characters
    assert '"name": "fund_account"' in shown_first and '"get_stock_info"' not in shown_first
    reveal = play(env, 100, ["I cannot do that yet."])[0]
    assert reveal.observation.startswith("# TradingBot: This tool belongs to the trading system")
    assert '{"name": "get_stock_info", "description": "Get the details of a stock."' in reveal.observation
    assert reveal.observation.endswith(
        "I have updated some more functions you can choose from. What about now?"
    )


class _Chars:
    """A stand-in tokenizer whose template is the messages' text, for checking what a prompt says."""

    def apply_chat_template(self, messages, **kwargs):
        if "tools" in kwargs:
            raise ValueError("no tools")
        return [ord(c) for c in "".join(m["content"] for m in messages)]


def test_turns_reward_is_the_share_of_turns_passed_and_diagnostics_are_logged():
    env = BFCLEnv("base", reward="turns")
    trs = play(
        env, 100, [call("get_stock_info", symbol="NVDA"), "Done.", call("fund_account", amount=2000), "Done."]
    )
    assert trs[-1].reward == 0.5
    task = next(t for t in env.tasks() if t.task_id == 100)
    d = env.diagnostics(task, trs[-1].state)
    assert (d["turns"], d["turns_passed"], d["calls"]) == (2.0, 1.0, 2.0)
    assert d["call_overlap"] == 0.5  # get_stock_info matches, fund_account(2000) does not
    assert 0.0 < d["state_score"] < 1.0
    # positional and keyword forms of one call overlap: sort('a') in a ground truth is sort(file_name='a')
    positional = Call.make("sort", {}, ["a.txt"])
    assert (
        call_overlap(
            [("GorillaFileSystem", Call.make("sort", {"file_name": "a.txt"}))],
            [("GorillaFileSystem", positional)],
        )
        == 1.0
    )


# ------------------------------------------------------------------------------------------- split


def test_80_20_split_by_entry_is_seeded_and_the_configs_agree():
    from hydra import compose, initialize_config_dir

    from trace_lightning import config

    env = BFCLEnv("base")
    ids = [t.task_id for t in env.tasks()]
    train, held = split_tasks(ids, env.held_out, seed=0)
    assert (len(train), len(held), train & held) == (160, 40, set())
    assert split_tasks(ids, env.held_out, seed=0) == (train, held)
    config.register()
    with initialize_config_dir(str(config.conf_dir()), version_base="1.3"):
        assert compose("train", overrides=["env=bfcl"]).data.held_out == 40
        assert compose("warmstart", overrides=["env=bfcl"]).held_out == 40
        assert compose("train").data.held_out == 200  # the default job's math_tool holds out its own 200
        assert compose("train", overrides=["env=search_qa"]).data.held_out == 16  # envs without a split
    with pytest.raises(ValueError, match="env.held_out"):
        BFCLEnv("base", held_out=200)


def test_demonstrations_replay_the_ground_truth_of_training_entries_only():
    from trace_lightning.demos import demonstrations

    env = BFCLEnv("base")
    train, held = split_tasks([t.task_id for t in env.tasks()], env.held_out, seed=0)
    demos, missing = demonstrations(env, set(sorted(train)[:6]))
    assert missing == 0 and len(demos) == 6 and not {d.task.task_id for d in demos} & held
    demo = next(d for d in demos)
    entry = env.entries[demo.task.task_id]
    assert len(demo.actions) == sum(len(t) for t in entry.ground_truth) + len(entry.turns)
    assert demo.reward == 1.0 and demo.actions[-1] == "Done."


# ------------------------------------------------------------------------------------------- runner


class ScriptedEngine:
    """Answers each prompt with the next text of a script (one episode at a time)."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.stats, self.texts = tokenizer, EngineStats(), list(texts)

    def generate(self, prompts, params):
        out = []
        for _ in prompts:
            ids = self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"]
            out.append(Completion(ids, [0.0] * len(ids), "stop"))
        return out

    def sync_weights(self):
        pass


def test_runner_plays_a_conversation_and_a_continuation_restores_its_prefix():
    from trace_lightning.iteration import Branch
    from trace_lightning.models import build_tiny_tokenizer
    from trace_lightning.runner import EpisodeLimits, ReActRunner

    tok = build_tiny_tokenizer()
    env = BFCLEnv("base", max_doc_chars=5000)
    script = [call("get_stock_info", symbol="NVDA"), "Done.", call("fund_account", amount=2203.4), "Done."]
    limits = EpisodeLimits(max_turns=8, max_episode_tokens=4000)
    runner = ReActRunner(ScriptedEngine(tok, script), tok, env, SamplingParams(64, 1.0), limits)
    tree = runner.new_tree(100)
    ledger = BudgetLedger(Budget(2))
    ledger.reserve_leaves(2, "bare")
    runner([Branch(tree, 0, 1, "bare")], ledger, np.random.default_rng(0))
    leaf = tree.nodes[tree.leaves()[0]]
    assert (leaf.reward, leaf.stop_reason, leaf.depth) == (1.0, "end", 4)
    # branch after the first call (node 1): the continuation funds the wrong amount and fails turn 1
    runner.engine.texts = ["Done.", call("fund_account", amount=1.0), "Done."]
    runner([Branch(tree, 1, 1, "expand")], ledger, np.random.default_rng(0))
    second = next(tree.nodes[x] for x in tree.leaves() if x != leaf.id)
    assert (second.reward, second.stop_reason) == (0.0, "end")
    states = [tree.env_states[n] for n in range(len(tree.nodes)) if n in tree.env_states]
    branch = next(s for s in states if Call.make("fund_account", {"amount": 1.0}) in s.calls)
    assert branch.calls == (
        Call.make("get_stock_info", {"symbol": "NVDA"}),
        Call.make("fund_account", {"amount": 1.0}),
    )
    assert tree.env_states[1].calls == (Call.make("get_stock_info", {"symbol": "NVDA"}),)
    assert call_text(Call.make("ls", {"a": True})) == call("ls", a=True)


# --------------------------------------------------------------------------------------- warm start


def test_warm_start_examples_train_every_call_and_end_each_reply_with_eos():
    from trace_lightning.demos import demonstrate
    from trace_lightning.models import build_tiny_tokenizer
    from trace_lightning.warmstart import IGNORE, select_examples, to_example

    tok = build_tiny_tokenizer()
    env = BFCLEnv("base", max_doc_chars=5000)
    task = next(t for t in env.tasks() if t.task_id == 100)
    demo = demonstrate(env, task)
    assert demo.actions == (
        call("get_stock_info", symbol="NVDA"),
        "Done.",
        call("fund_account", amount=2203.4),
        "Done.",
    )
    example = to_example(tok, env.system_prompt, demo, env=env)
    prompt = env.prompt_ids(task, tok)
    assert example.input_ids[: len(prompt)] == prompt and set(example.labels[: len(prompt)]) == {IGNORE}
    trained = [i for i, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE]
    # the two calls, then each reply followed by EOS (the engine stops a reply there); observations masked
    expected = []
    for action in demo.actions:
        expected += tok(action, add_special_tokens=False)["input_ids"]
        if not action.endswith("</tool_call>"):
            expected.append(tok.eos_token_id)
    assert trained == expected and trained.count(tok.eos_token_id) == 2
    longer = demonstrate(env, next(t for t in env.tasks() if t.task_id == 11))
    sizes = [len(to_example(tok, "", d, env=env).input_ids) for d in (demo, longer)]
    kept = select_examples(tok, env, [demo, longer], min(sizes), None)  # the token cap keeps the shorter
    assert [len(e.input_ids) for e in kept] == [min(sizes)]
    assert len(select_examples(tok, env, [demo, longer], None, 1)) == 1
