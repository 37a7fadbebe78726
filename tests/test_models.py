import importlib.util
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trace_lightning import models
from trace_lightning.models import TAGS, build_policy, build_tiny_model, build_tiny_tokenizer, prepare_smollm2


def test_tiny_model_builds_fast_and_reloads_offline(tmp_path, tiny_model_dir):
    build_tiny_model(tmp_path / "warm")  # the first build in a process also pays transformers' lazy imports
    start = time.perf_counter()
    path = build_tiny_model(tmp_path / "m", seed=1)
    assert time.perf_counter() - start < 1.0
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "qwen3" and model.dtype == torch.float32
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert model.config.vocab_size == len(tokenizer)
    assert sum(p.numel() for p in model.parameters()) < 200_000


def test_same_seed_same_weights(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "a", seed=3))
    b = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "b", seed=3))
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_tiny_tokenizer_specials_and_vocab():
    tok = build_tiny_tokenizer()
    assert 600 <= len(tok) <= 700
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.padding_side == "left"
    for special in models.SPECIAL_TOKENS:
        assert len(tok.encode(special)) == 1


def test_tags_tokenize_compactly_and_round_trip():
    tok = build_tiny_tokenizer()
    for tag in TAGS:
        opening, closing = f"<{tag}>", f"</{tag}>"
        # the tag name is learned as one token; byte-level pre-tokenization keeps '<', '</', '>' apart
        assert len(tok.encode(opening)) == 3 and len(tok.encode(closing)) == 3
        text = f"{opening}12 * 4 = 48, café ünïcode{closing}"
        assert tok.decode(tok.encode(text)) == text


def test_chat_template_renders_chatml():
    tok = build_tiny_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "<answer>hello</answer>"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
        "<|im_start|>assistant\n<answer>hello</answer><|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")


def test_build_policy(tiny_model_dir):
    model, tok = build_policy(tiny_model_dir)
    assert tok.padding_side == "left" and tok.pad_token == "<|endoftext|>"
    assert model.dtype == torch.float32


def test_build_policy_sets_missing_pad_token(tmp_path):
    path = build_tiny_model(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = None
    tok.padding_side = "right"
    tok.save_pretrained(path)
    _, loaded = build_policy(path)
    assert loaded.pad_token == loaded.eos_token and loaded.padding_side == "left"


def test_build_policy_errors_name_the_setting(tmp_path, tiny_model_dir):
    with pytest.raises(FileNotFoundError, match=r"model\.path"):
        build_policy(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"dtype=.float33."):
        build_policy(tiny_model_dir, dtype="float33")


def test_prepare_smollm2_without_package_says_make_data(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModuleNotFoundError, match="make data"):
        prepare_smollm2(tmp_path / "cache")


def test_prepare_smollm2_reuses_complete_folder_only(tmp_path, monkeypatch):
    done = tmp_path / "done"
    done.mkdir()
    (done / models._COMPLETE_MARKER).write_text("ok")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # any conversion attempt fails
    assert prepare_smollm2(done) == str(done)
    half = tmp_path / "interrupted"
    half.mkdir()
    (half / "config.json").write_text("{}")  # no marker: the conversion must run again
    with pytest.raises(ModuleNotFoundError):
        prepare_smollm2(half)


def test_prepare_smollm2_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_LIGHTNING_CACHE", str(tmp_path))
    target = tmp_path / "smollm2-135m-instruct"
    target.mkdir()
    (target / models._COMPLETE_MARKER).write_text("ok")
    assert prepare_smollm2() == str(target)
