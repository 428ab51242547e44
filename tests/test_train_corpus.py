"""Training prompts from the corpus: the open requests are short and seeded by the corpus's own
text, adding them leaves the other prompts as they were, and the answer order interleaves the
sources so that growing one count keeps every earlier prompt's place."""

import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaspec.train.corpus import (
    BRIEF_CODE_TASKS,
    BRIEF_NAME_TASKS,
    BRIEF_NUMBER_TASKS,
    OPEN_CODE_TASKS,
    OPEN_NEWS_TASKS,
    OPEN_NUMBER_TASKS,
    SOURCES,
    TOPIC_TASKS,
    PromptRecord,
    _draws,
    build_prompts,
    documented_functions,
    function_tasks,
    news_names,
    news_sentences,
    news_topics,
    number_pairs,
)
from adaspec.train.objective import TrainingError
from adaspec.train.pipeline import respond_order
from adaspec.train.recipe import Recipe


@pytest.fixture
def sentences(tmp_path, corpus):
    """The tiny corpus with articles of several sentences (its own lines are one long one)."""
    line = (
        "The council of the river city met on Monday to talk about the flood. "
        "It said that 12 roads and 5 bridges were closed and that water levels rose again. "
        "The mayor, Anna River Smith, asked the State Emergency Service for 3 more boats. "
    ) * 3
    (tmp_path / "news.txt").write_text(line + "\n" + line.replace("12", "40") + "\n")
    (tmp_path / "code_modules.txt").write_text((corpus / "code_modules.txt").read_text())
    return tmp_path


def test_open_prompts_are_short_requests_seeded_by_corpus_text(sentences):
    corpus = sentences
    prompts = build_prompts(corpus, n_news=0, n_code=0, n_open=40, seed=0)
    seeds = news_sentences(corpus / "news.txt") + documented_functions(corpus / "code_modules.txt")
    assert 0 < len(prompts) <= 40 and {p.source for p in prompts} == {"open"}
    assert len({p.key for p in prompts}) == len(prompts)
    tasks = OPEN_NEWS_TASKS + OPEN_NUMBER_TASKS + OPEN_CODE_TASKS
    templates = [t.split("{text}")[0] for t in tasks]
    for p in prompts:
        text = p.messages[0]["content"]
        assert any(s in text for s in seeds), text
        assert len(text) < 500
    # every template is drawn: sentences (story, explain, arithmetic), functions (code)
    for t in templates:
        assert any(p.messages[0]["content"].startswith(t) for p in prompts), t


def test_documented_functions_name_a_signature_and_the_docstrings_first_line(corpus):
    funcs = documented_functions(corpus / "code_modules.txt")  # colorsys and bisect
    assert '`bisect_left(a, x, lo, hi)`, described as "Return the index where' in " ".join(funcs)
    assert all(f.startswith("`") and ', described as "' in f for f in funcs)


def test_adding_open_prompts_keeps_the_news_and_code_prompts(corpus):
    base = build_prompts(corpus, n_news=5, n_code=4, seed=1)
    more = build_prompts(corpus, n_news=5, n_code=4, n_open=6, seed=1)
    assert more[:9] == base and len(more) == 15


@given(st.lists(st.sampled_from(SOURCES), max_size=30), st.integers(0, len(SOURCES) - 1))
def test_answer_order_keeps_its_prefix_when_one_source_grows(sources, grown):
    """Growing one source's count only inserts its new prompts: the others keep their order."""
    recs = [PromptRecord(f"{s}-{i:05d}", s, False, ()) for i, s in enumerate(sources)]
    extra = SOURCES[grown]
    bigger = recs + [PromptRecord(f"{extra}-x{i}", extra, False, ()) for i in range(3)]
    before, after = respond_order(recs), respond_order(bigger)
    assert [p for p in after if p in recs] == before
    assert sorted(p.id for p in after) == sorted(p.id for p in bigger)
    # the sources take turns while each lasts: the first n*m prompts are m rounds of n
    n = len(SOURCES)
    m = min(sum(p.source == s for p in bigger) for s in SOURCES)
    rounds = [after[n * i : n * i + n] for i in range(m)]
    assert all([p.source for p in r] == list(SOURCES) for r in rounds)


@pytest.mark.parametrize("field", ["n_open", "n_brief", "n_topic", "n_self"])
def test_a_negative_count_is_refused_naming_it(field):
    with pytest.raises(TrainingError, match=f"{field}=-1"):
        Recipe(corpus=str(Path(".")), **{field: -1})


def test_brief_requests_carry_a_name_a_task_or_two_numbers_and_nothing_to_copy(sentences):
    corpus = sentences
    names, pairs = news_names(corpus / "news.txt"), number_pairs(corpus / "news.txt")
    tasks = function_tasks(corpus / "code_modules.txt")
    # a name inside a sentence, never the capitalised word that opens one
    assert names == ["Anna River Smith", "State Emergency Service"]
    assert pairs == ["12 and 5", "40 and 5"]
    assert "returns the index where to insert item x in list a, assuming a is sorted." in tasks
    assert all(t[0].islower() and t.endswith(".") for t in tasks)
    prompts = build_prompts(corpus, n_news=0, n_code=0, n_brief=60, seed=0)
    assert {p.source for p in prompts} == {"brief"}
    seeds = names + pairs + tasks
    for t in BRIEF_NAME_TASKS + BRIEF_CODE_TASKS + BRIEF_NUMBER_TASKS:
        made = [p.messages[0]["content"] for p in prompts]
        # every template is drawn, each prompt is one template around one seed
        assert any(t.format(text=s) in made for s in seeds), t
    for p in prompts:
        text = p.messages[0]["content"]
        assert len(text) < 200 and not any(s in text for s in news_sentences(corpus / "news.txt"))


def test_topic_requests_wrap_a_repeated_lowercase_phrase_of_the_news(sentences):
    corpus = sentences
    topics = news_topics(corpus / "news.txt")
    text = (corpus / "news.txt").read_text()
    # noun phrases of the articles; never a function, time or number word, never a name
    assert "river city" in topics and "water levels" in topics
    assert all(t.islower() and len(t.split()) == 2 and text.count(t) >= 2 for t in topics)
    assert not any(w in ("that", "more", "said") for t in topics for w in t.split())
    assert news_topics(corpus / "news.txt", min_count=7) == []  # each occurs 6 times
    prompts = build_prompts(corpus, n_news=0, n_code=0, n_topic=40, seed=0)
    assert 0 < len(prompts) <= 40 and {p.source for p in prompts} == {"topic"}
    made = [p.messages[0]["content"] for p in prompts]
    assert len(set(made)) == len(made)
    assert all(any(t.format(text=s) in made for s in topics) for t in TOPIC_TASKS)


def test_adding_brief_requests_keeps_every_other_prompt(corpus):
    base = build_prompts(corpus, n_news=5, n_code=4, n_open=3, seed=1)
    more = build_prompts(corpus, n_news=5, n_code=4, n_open=3, n_brief=4, seed=1)
    assert more[: len(base)] == base and len(base) < len(more) <= len(base) + 4


@given(
    st.lists(st.integers(1, 3), min_size=1, max_size=12),
    st.integers(0, 40),
    st.integers(0, 40),
    st.booleans(),
)
def test_draws_never_repeat_a_prompt_and_keep_their_prefix(tasks_per_seed, n, m, repeat):
    """However many draws are asked for, no (seed, task) pair comes twice; with distinct seed
    texts every pair is drawn before the draws stop; fewer draws give a prefix of more."""
    seeds = [(f"s{i}", tuple(f"t{j}" for j in range(k))) for i, k in enumerate(tasks_per_seed)]
    if repeat:  # a seed text that occurs twice (the corpus has some)
        seeds.append(seeds[0])
    few, many = sorted((n, m))
    a = _draws(seeds, few, random.Random(0))
    b = _draws(seeds, many, random.Random(0))
    pairs = [(t, k) for _, t, k in b]
    assert len(set(pairs)) == len(pairs) and b[: len(a)] == a
    assert all(i < many for i, _, _ in b) and [i for i, _, _ in b] == sorted({i for i, *_ in b})
    if not repeat:
        assert len(b) == min(many, sum(tasks_per_seed))


def test_the_model_card_counts_brief_requests_only_when_a_run_had_some():
    from adaspec.train.card import prompt_counts

    r = {"n_news": 2, "n_code": 3, "n_open": 4}
    assert prompt_counts(r) == "2 news prompts, 3 code prompts, 4 short open requests"
    assert prompt_counts({**r, "n_brief": 5}).endswith(", 4 short open requests, 5 brief requests")
