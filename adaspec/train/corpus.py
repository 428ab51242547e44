"""Training prompts from a text corpus: news articles and Python source files, each wrapped in
one of a few instruction templates (grounded: summarize, extract, answer, document, edit; open:
continue, explain, write), plus short open requests seeded by one news sentence or one stdlib
function's signature and docstring (story, explain, arithmetic, code from a description), and
brief requests that carry no text to copy: a name from the news, a task a stdlib docstring
describes, two numbers from a news sentence. The target writes the responses; this module only
asks."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .objective import TrainingError

# the corpus that ships with adaspec (news.txt, code_modules.txt); --corpus DIR replaces it
SHIPPED_CORPUS = Path(__file__).resolve().parent / "corpus_data"

NEWS_TASKS = (
    "Summarize the following news article in a few sentences.\n\n{text}",
    "List the people, places and organisations named in this article, one per line.\n\n{text}",
    "Read the article and answer: what happened, where, and why does it matter?\n\n{text}",
    "Rewrite the first paragraph of this article in plain, simple English.\n\n{text}",
    "Write a short headline and a two-sentence summary for this article.\n\n{text}",
    "Continue this news story with two more paragraphs.\n\n{text}",
    "Write a short story inspired by this news report.\n\n{text}",
    "Explain the background of this news for a reader who knows nothing about it.\n\n{text}",
)
CODE_TASKS = (
    "Explain what this Python code does.\n\n```python\n{text}\n```",
    "Add docstrings and type hints to this Python code.\n\n```python\n{text}\n```",
    "Write unit tests with pytest for this Python code.\n\n```python\n{text}\n```",
    "Refactor this Python code to make it easier to read.\n\n```python\n{text}\n```",
    "Find possible bugs in this Python code and show a fixed version.\n\n```python\n{text}\n```",
    "Write a short tutorial on how to use this code.\n\n```python\n{text}\n```",
)

# short prompts whose answer carries the text (the dev suite's open categories): one news
# sentence or one documented stdlib function is only the seed
OPEN_NEWS_TASKS = (
    "Write a short story that begins with this sentence: {text}",
    "Explain to a beginner the background of this sentence from the news: {text}",
)
OPEN_NUMBER_TASKS = (
    "Write an arithmetic word problem that uses the numbers in this sentence, then solve it "
    "step by step: {text}",
)
OPEN_CODE_TASKS = (
    "Write a Python function {text}",
    "Explain to a beginner how a Python function {text} could be implemented.",
)

# brief requests worded as the dev suite's open categories are: the seed is a name, a task or
# two numbers, so the answer has next to nothing in its prompt to copy
BRIEF_NAME_TASKS = (
    "Write a short story about {text}.",
    "Explain who or what {text} is to a beginner.",
)
BRIEF_CODE_TASKS = ("Write a Python function that {text}",)
BRIEF_NUMBER_TASKS = (
    "Write a word problem that uses the numbers {text}, then solve it. Explain step by step.",
)

# requests about a topic of the news (two lowercase words that occur together at least twice,
# "interest rates"), worded in more ways than the brief requests: a drafter generalises little
# beyond the kinds of request it was trained on (docs/training.md)
TOPIC_TASKS = (
    "Write a short story about {text}.",
    "Explain {text} to a beginner.",
    "Describe {text} in simple words.",
    "Write a short poem about {text}.",
    "What should a student know about {text}? Answer in a few paragraphs.",
    "Give three facts about {text}, each with a short explanation.",
)

# the prompt sources, in the order build_prompts emits them and answers take turns
SOURCES = ("news", "code", "open", "brief", "topic")


@dataclass(frozen=True)
class PromptRecord:
    id: str
    source: str  # one of SOURCES
    heldout: bool
    messages: tuple[dict, ...]

    @property
    def key(self) -> str:
        """What identifies a prompt across runs and machines: a hash of its messages."""
        text = json.dumps(list(self.messages), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "source": self.source,
            "heldout": self.heldout,
            "messages": list(self.messages),
        }

    @classmethod
    def from_json(cls, d: dict) -> PromptRecord:
        return cls(d["id"], d["source"], bool(d["heldout"]), tuple(d["messages"]))


def news_chunks(path: Path, max_chars: int) -> list[str]:
    """One chunk per article (one article per line), cut at a sentence end below max_chars."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if len(text) < 200:
            continue
        if len(text) > max_chars:
            cut = text.rfind(". ", 0, max_chars)
            text = text[: cut + 1 if cut > max_chars // 2 else max_chars]
        out.append(text)
    return out


def code_chunks(modules_file: Path, max_chars: int) -> list[str]:
    """Consecutive chunks of whole lines (up to max_chars) of each listed stdlib module's source;
    modules not present as .py files in this Python are skipped."""
    out = []
    for source in _module_sources(modules_file):
        chunk: list[str] = []
        size = 0
        for line in source.splitlines():
            if size + len(line) + 1 > max_chars and chunk:
                out.append("\n".join(chunk).strip("\n"))
                chunk, size = [], 0
            chunk.append(line)
            size += len(line) + 1
        if chunk:
            out.append("\n".join(chunk).strip("\n"))
    return [c for c in out if len(c) >= 200]


def _module_sources(modules_file: Path) -> list[str]:
    """The source text of each listed stdlib module that exists as a .py file in this Python."""
    out = []
    for name in modules_file.read_text(encoding="utf-8").split():
        spec = importlib.util.find_spec(name)
        origin = getattr(spec, "origin", None) or ""
        if origin.endswith(".py"):
            out.append(Path(origin).read_text(encoding="utf-8", errors="replace"))
    return out


def news_sentences(path: Path, lo: int = 60, hi: int = 300) -> list[str]:
    """Every sentence of the articles between lo and hi characters long."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        for part in line.strip().split(". "):
            part = part.strip()
            if lo <= len(part) + 1 <= hi:
                out.append(part if part.endswith((".", "?", "!", '"')) else part + ".")
    return out


def _documented(modules_file: Path) -> list[tuple[str, str]]:
    """(`name(args)`, first docstring line) for each public function of the listed modules
    whose docstring opens with a line of 20 characters or more."""
    out = []
    for source in _module_sources(modules_file):
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = (ast.get_docstring(node) or "").split("\n")[0].strip()
            if len(doc) >= 20:
                args = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
                out.append((f"{node.name}({args})", doc))
    return out


def documented_functions(modules_file: Path) -> list[str]:
    """`name(args)`, described as "first docstring line", for each public function of the
    listed modules whose docstring opens with a line of 20 characters or more."""
    return [f'`{sig}`, described as "{doc}"' for sig, doc in _documented(modules_file)]


# a run of two or more capitalised words, not at the start of a sentence
_NAME = re.compile(r"(?<=[a-z,] )([A-Z][a-z]+(?: [A-Z][a-z]+)+)")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?!\w)")


def news_names(path: Path) -> list[str]:
    """Distinct names of two or more capitalised words inside the news sentences, in order of
    first appearance."""
    found = (m.group(1) for s in news_sentences(path) for m in _NAME.finditer(s))
    return list(dict.fromkeys(found))


# words a topic never contains: function words, time and number words, reporting verbs
_NOT_TOPIC = frozenset(
    "that this with from have been were will would could should their there they them what "
    "when where which while about after before other into over than then these those also just "
    "only some such very more most much many said says told being because against between "
    "during under until among within without across around since your year years week weeks "
    "month months night nights time times days today yesterday tomorrow morning afternoon "
    "evening first second third last next three four five seven eight nine hundred thousand "
    "million billion still even though take took make made give gave come came going like well "
    "good back down past minutes hours early late least same another every each whole".split()
)


def _topic_word(w: str) -> bool:
    return (
        w.isalpha()
        and w.islower()
        and len(w) >= 4
        and w not in _NOT_TOPIC
        and not w.endswith(("ly", "ed", "ing"))
    )


def news_topics(path: Path, min_count: int = 2) -> list[str]:
    """Distinct pairs of adjacent lowercase words of the news (neither a function, time or
    number word, an adverb or a participle) inside one clause, occurring at least min_count
    times: noun phrases such as "interest rates", most frequent first."""
    counts: dict[str, int] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        for clause in re.split(r"[.!?;:,\"()]", line):
            words = clause.split()
            for a, b in zip(words, words[1:]):
                if _topic_word(a) and _topic_word(b):
                    counts[f"{a} {b}"] = counts.get(f"{a} {b}", 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])  # stable: first seen first on ties
    return [t for t, n in ranked if n >= min_count]


def number_pairs(path: Path) -> list[str]:
    """Distinct "A and B": the first two distinct numbers of each news sentence that has two."""
    pairs = []
    for sentence in news_sentences(path):
        nums = list(dict.fromkeys(_NUMBER.findall(sentence)))
        if len(nums) >= 2:
            pairs.append(f"{nums[0]} and {nums[1]}")
    return list(dict.fromkeys(pairs))


_VERB_ES = ("s", "sh", "ch", "x", "z", "o")  # endings whose third person takes -es


def _third_person(verb: str) -> str:
    if verb.endswith("y") and verb[-2:-1] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + ("es" if verb.endswith(_VERB_ES) else "s")


# the imperative verbs a docstring's first line may open with to become a task
_VERBS = frozenset(
    "return get set create make check convert compute calculate open close read write remove "
    "add find parse decode encode draw display construct build test send start stop call "
    "format split join copy move delete load save print run update reset clear register "
    "generate validate handle process initialize change wait put insert append extract search "
    "match replace apply decrypt encrypt compare count sort filter map reverse fetch store "
    "show hide list quote unquote escape strip wrap pack unpack push pop".split()
)


def function_tasks(modules_file: Path) -> list[str]:
    """The first docstring lines of the listed modules' public functions that are one whole
    sentence opening with an imperative verb, as a task: "Return the index ..." -> "returns
    the index ...". Distinct, in order."""
    tasks = []
    for _, doc in _documented(modules_file):
        first, _, rest = doc.partition(" ")
        if first.lower() in _VERBS and rest and doc.endswith(".") and ". " not in doc:
            tasks.append(f"{_third_person(first.lower())} {rest}")
    return list(dict.fromkeys(tasks))


def _brief_items(corpus: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(seed, the templates that fit it): news names, function tasks, number pairs."""
    news, code = corpus / "news.txt", corpus / "code_modules.txt"
    items: list[tuple[str, tuple[str, ...]]] = [(t, BRIEF_NAME_TASKS) for t in news_names(news)]
    items += [(t, BRIEF_CODE_TASKS) for t in function_tasks(code)]
    return items + [(t, BRIEF_NUMBER_TASKS) for t in number_pairs(news)]


def _open_items(corpus: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(seed text, the templates that fit it): news sentences, then documented functions."""
    items = []
    for text in news_sentences(corpus / "news.txt"):
        digits = any(ch.isdigit() for ch in text)
        items.append((text, OPEN_NEWS_TASKS + (OPEN_NUMBER_TASKS if digits else ())))
    items += [(text, OPEN_CODE_TASKS) for text in documented_functions(corpus / "code_modules.txt")]
    return items


def _heldout(text: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def build_prompts(
    corpus: Path,
    *,
    n_news: int,
    n_code: int,
    seed: int,
    heldout: float = 0.05,
    max_chars: int = 1500,
    n_open: int = 0,
    n_brief: int = 0,
    n_topic: int = 0,
) -> list[PromptRecord]:
    """Up to n_news + n_code + n_open + n_brief + n_topic prompts: n draws per source, seed
    texts drawn without replacement while they last, then reused with a task they have not had;
    a draw that would repeat a prompt is dropped (its id stays unused), so every prompt is distinct
    and a source whose (seed, task) pairs run out yields fewer. The held-out split is decided
    by a hash of the seed text."""
    news_file, code_file = corpus / "news.txt", corpus / "code_modules.txt"
    for f in (news_file, code_file):
        if not f.is_file():
            raise TrainingError(
                f"corpus file {str(f)!r} does not exist; accepted: a corpus folder with "
                "news.txt and code_modules.txt"
            )
    sources = (
        ("news", n_news, lambda: [(t, NEWS_TASKS) for t in news_chunks(news_file, max_chars)]),
        ("code", n_code, lambda: [(t, CODE_TASKS) for t in code_chunks(code_file, max_chars)]),
        ("open", n_open, lambda: _open_items(corpus)),
        ("brief", n_brief, lambda: _brief_items(corpus)),
        ("topic", n_topic, lambda: [(t, TOPIC_TASKS) for t in news_topics(news_file)]),
    )
    records = []
    for source, n, items in sources:
        seeds = items() if n > 0 else []
        if n > 0 and not seeds:
            raise TrainingError(f"corpus {str(corpus)!r} yields no {source} text")
        records += [
            PromptRecord(
                id=f"{source}-{i:05d}",
                source=source,
                heldout=_heldout(text, heldout),
                messages=({"role": "user", "content": task.format(text=text)},),
            )
            for i, text, task in _draws(seeds, n, random.Random(f"{seed}-{source}"))
        ]
    return records


def _draws(
    seeds: Sequence[tuple[str, tuple[str, ...]]], n: int, rng: random.Random
) -> list[tuple[int, str, str]]:
    """(draw number, seed text, task) of n draws, repeats dropped. The first pass over the
    seeds draws a task from all of a seed's tasks (so a count change keeps earlier prompts);
    a later pass holds only the seeds with a task they have not had, and draws among those."""
    used: set[tuple[str, str]] = set()
    order: list[tuple[str, tuple[str, ...]]] = []
    out, passes = [], 0
    for i in range(n):
        if not order:
            order = [(t, ks) for t, ks in seeds if any((t, k) not in used for k in ks)]
            if not order:
                break  # every (seed, task) pair was drawn
            rng.shuffle(order)
            passes += 1
        text, tasks = order.pop()
        fresh = [k for k in tasks if (text, k) not in used]
        task = rng.choice(tasks if passes == 1 else fresh or tasks)
        if (text, task) not in used:
            used.add((text, task))
            out.append((i, text, task))
    return out
