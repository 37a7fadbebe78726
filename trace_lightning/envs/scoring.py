"""Answer verifiers: SQuAD-style exact match and token F1, and numeric match for math.

All functions are pure and total: any text in, a score out. The normalisation follows the SQuAD
v1.1 evaluation script (lowercase, drop punctuation and the articles a/an/the, collapse spaces), so
scores are comparable with published QA numbers.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Literal

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
# A number as people write it: optional sign and $, thousands commas or plain digits, decimals, %.
_NUMBER = re.compile(r"(?<![\w.])[-+−]?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?%?|(?<![\w.])[-+−]?\$?\.\d+%?")


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(pred: str, golds: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold, else 0.0."""
    norm = normalize_answer(pred)
    return float(any(norm == normalize_answer(gold) for gold in golds))


def token_f1(pred: str, golds: Sequence[str]) -> float:
    """The best SQuAD token F1 of `pred` against any gold (0.0 when there are no golds)."""
    return max((_f1(pred, gold) for gold in golds), default=0.0)


def _f1(pred: str, gold: str) -> float:
    pred_tokens, gold_tokens = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        # SQuAD's convention: two empty answers agree, one empty answer scores zero
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def parse_number(text: str) -> float | None:
    """The last number written in `text` ("$1,234.50" -> 1234.5, "50%" -> 50), or None.

    The last one, because a worked answer ("12 + 7 = 19 apples") ends with its result.
    """
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    raw = matches[-1].replace("−", "-").translate(str.maketrans("", "", "$,%+"))
    try:
        return float(raw)
    except ValueError:  # unreachable for what the pattern matches, but parsing must never raise
        return None


def is_number(text: str) -> bool:
    """True when `text` is a single number and nothing else (units and words excluded)."""
    return _NUMBER.fullmatch(text.strip()) is not None


def numbers_match(pred: str, gold: str, tol: float = 1e-6) -> bool:
    """Whether the last number in `pred` equals the number in `gold` (relative tolerance above 1)."""
    p, g = parse_number(pred), parse_number(gold)
    if p is None or g is None:
        return False
    return abs(p - g) <= tol * max(1.0, abs(g))


def contains_answer(pred: str, golds: Sequence[str]) -> float:
    """1.0 if some normalised gold appears as a whole-word span of the normalised prediction.

    For small chat models that answer in a sentence ("The capital is Rome."), where EM is always 0.
    Lenient by design, so it can be gamed: a reply that lists several candidates including the gold
    counts as correct (15 common golds in one reply win 30 of the 76 search_qa tasks). The shipped
    config uses token F1, which divides the credit by the reply's length.
    """
    words = normalize_answer(pred).split()
    for gold in golds:
        g = normalize_answer(gold).split()
        if g and any(words[i : i + len(g)] == g for i in range(len(words) - len(g) + 1)):
            return 1.0
    return 0.0


def score_answer(pred: str, golds: Sequence[str], reward: Literal["em", "f1", "contains"]) -> float:
    """EM, token F1 or containment against the accepted answers, in [0, 1]. A gold that is a plain
    number also accepts the same number written with units or commas ("8,611 m" for 8611)."""
    if any(is_number(gold) and numbers_match(pred, gold) for gold in golds):
        return 1.0
    if reward == "contains":
        return contains_answer(pred, golds)
    return exact_match(pred, golds) if reward == "em" else token_f1(pred, golds)
