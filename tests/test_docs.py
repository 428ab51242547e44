"""The docs stay true: every knob documented, CI runs the README's test command, README's and
docs' result figures are those of the files in docs/results, and no history in the docs."""

import json
import re
from pathlib import Path

from adaspec.settings import Settings, env_name

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [env_name(f) for f in Settings.model_fields if f"`{env_name(f)}`" not in readme]
    assert not missing


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = readme.split("Run the tests")[1].split("```bash\n")[1].split("\n")[0]
    assert test_cmd in ci.splitlines()
    install = readme.split("```bash\n")[1].split("\n")[0]  # the first command installs
    for step in install.split(" && "):
        if step.startswith("pip install"):
            assert f"python -m {step}".replace("pip install", "pip install --quiet") in ci


# --- results: README's figures are the JSON's, every results file is cited, no history ---

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CARD = ROOT / "adaspec/drafters/checkpoints/smollm2-135m-dflash/README.md"
RESULTS = ROOT / "docs" / "results"
RESULT_NAME = re.compile(r"results/([A-Za-z0-9_.-]+\.(?:jsonl|json|png))")
# words that tell how the project got here; that belongs in CHANGELOG.md
HISTORY = re.compile(
    r"\bsessions?\b|\bthe issue\b|\bissue \d|\bprevious\b|\bused to\b|\bno longer\b"
    r"|\bcommit [0-9a-f]{7}\b|\bs\d-|\bbefore the (fix|change)|\bafter the fix\b|\bnot yet\b"
    r"|\brun \d+\b|\bnot shipped\b"
    r"|\bearlier (runs?|figures?|results?|measurements?|versions?|sessions?)\b"
    r"|\bbefore (the |its |adaspec's )?(\w+ ){0,2}"
    r"(fix|change|kernel|prefetch|policy|patch|rewrite|version|release|refactor|update|merge)\b"
    r"|\bsuperseded\b|\bpredate",
    re.IGNORECASE,
)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _table_rows(text: str):
    """(header cells, row cells) of every markdown table row outside code blocks."""
    header, in_code = None, False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code, header = not in_code, None
            continue
        if in_code or not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(line) <= set("|-: "):
            yield header, cells


def _figure(header: str, summary: dict) -> str | None:
    """The figure a column of a results table prints, recomputed from `summary`."""
    h = header.lower().replace("`", "")
    group = next((g for g in ("grounded", "open", "all") if h.split(" (")[0] == g), None)
    if group or h == "vs ar":
        return f"{summary[group or 'all']['median_speedup']:.2f}x"
    if h in summary["by_category"]:
        return f"{summary['by_category'][h]['median_speedup']:.2f}x"
    if h == "lowest category":
        name, b = min(summary["by_category"].items(), key=lambda kv: kv[1]["median_speedup"])
        return f"{name} {b['median_speedup']:.2f}x"
    if h == "mlx-lm spec vs ar":
        return f"{summary['all']['median_peer_speedup']:.2f}x"
    if h == "vs mlx-lm spec":
        return f"{summary['all']['median_spec_vs_peer']:.2f}x"
    stock = re.fullmatch(r"vs stock mlx-lm: (grounded|open|all)", h)
    if stock:
        return f"{summary[stock.group(1)]['median_spec_vs_stock']:.2f}x"
    if h == "stock mlx-lm tok/s":
        return f"{summary['all']['median_stock_tok_s']:.1f}"
    if h == "mlx-lm ar vs stock":
        return f"{summary['all']['median_ar_vs_stock']:.2f}x"
    if h == "identical to stock mlx-lm":
        return f"{summary['all']['stock_identical']}/{summary['all']['prompts']}"
    a = summary["all"]
    rates = {
        "adaspec tok/s": "median_spec_tok_s",
        "mlx-lm ar tok/s": "median_ar_tok_s",
        "llama.cpp tok/s": "median_llama_tok_s",
        "ngram-mod tok/s": "median_llama_ngram_tok_s",
    }
    if h in rates and rates[h] in a:
        return f"{a[rates[h]]:.1f}"
    if h in ("vs llama.cpp", "vs ngram-mod") and "median_spec_vs_llama" in a:
        return f"{a['median_spec_vs_llama' + ('_ngram' * (h == 'vs ngram-mod'))]:.2f}x"
    if h == "mlx-lm's ar vs llama.cpp" and "median_ar_vs_llama" in a:
        return f"{a['median_ar_vs_llama']:.2f}x"
    if h == "same text as llama.cpp" and "llama_same_text" in a:
        return f"{a['llama_same_text']}/{a['prompts']}"
    if h == "floored steps":
        return f"{summary['all']['floored_fraction']:.0%}"
    if h == "identical":
        return f"{summary['all']['identical']}/{summary['all']['prompts']}"
    return None


def _checked_cells(text: str):
    """(file, column, printed, recomputed) for each figure of a table row citing a bench JSON."""
    from adaspec.bench.report import summarize

    for header, cells in _table_rows(text):
        cited = [m for c in cells for m in RESULT_NAME.findall(c) if m.startswith("bench-")]
        if len(cited) != 1:
            continue
        result = json.loads((RESULTS / cited[0]).read_text())
        summary = summarize(result["records"])
        for col, cell in zip(header, cells):
            want = _figure(col, summary)
            machine = result.get("config", {}).get("machine", {})
            if col == "machine" and "peak_gflops" in machine:
                want = f"{machine['peak_gflops']:.0f} GFLOP/s, {machine['read_gbs']:.0f} GB/s"
            printed = cell.replace("*", "")
            if want is not None and printed:
                yield cited[0], col, printed, want


def test_readme_and_docs_figures_are_the_results_files():
    checked = 0
    for path in DOCS:
        for name, col, printed, want in _checked_cells(path.read_text()):
            assert printed == want, f"{path.name}: {name}, column {col!r}: {printed} != {want}"
            checked += 1
    readme = sum(1 for _ in _checked_cells((ROOT / "README.md").read_text()))
    assert readme >= 30 and checked > readme  # the tables are found, not skipped


def test_a_wrong_figure_is_caught():
    text = (ROOT / "README.md").read_text()
    cell = re.search(r"\| \*\*(\d+\.\d\d)x\*\* \|", text)  # the first bold result figure
    assert cell, "README has no bold result figure"
    wrong = f"| **{float(cell.group(1)) + 0.01:.2f}x** |"
    broken = text[: cell.start()] + wrong + text[cell.end() :]
    assert broken != text
    assert any(printed != want for _, _, printed, want in _checked_cells(broken))


def test_every_cited_results_file_exists_and_every_file_is_cited():
    cited: set[str] = set()
    for path in [*DOCS, CARD, ROOT / "CHANGELOG.md", RESULTS / "README.md"]:
        cited |= set(RESULT_NAME.findall(path.read_text()))
    on_disk = {p.name for p in RESULTS.iterdir() if p.name != "README.md"}
    assert not cited - on_disk, f"cited but missing: {sorted(cited - on_disk)}"
    assert not on_disk - cited, f"in docs/results but cited nowhere: {sorted(on_disk - cited)}"


def test_links_between_docs_reach_a_heading():
    def anchors(path: Path) -> set[str]:
        heads = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
        return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}

    for path in DOCS:
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)#([\w-]+)\)", path.read_text()):
            dest = (path.parent / target).resolve()
            assert dest.is_file(), f"{path.name} links to missing {target}"
            assert anchor in anchors(dest), (
                f"{path.name} links to {target}#{anchor}: no such heading"
            )


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_dates_only_in_results():
    """Docs pages say how things work now; when a figure was measured is in its results file's
    index line (docs/results/README.md) and in CHANGELOG.md; README dates its Results."""
    readme = (ROOT / "README.md").read_text()
    before, _, results = readme.partition("\n## Results\n")
    assert results and not DATE.search(before), "README: a date outside the Results section"
    for path in [*DOCS[1:], CARD]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not DATE.search(line), f"{path.name}:{n}: a date: {line.strip()}"


def test_a_history_line_is_caught():
    for line in (
        "Run 9: the topic requests",
        "not shipped",
        "earlier runs",
        "peer k=3, before the kernel's L2 prefetch",
    ):
        assert HISTORY.search(line), line


def test_docs_describe_the_project_as_it_is():
    for path in [*DOCS, CARD]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not HISTORY.search(line), f"{path.name}:{n}: history word: {line.strip()}"


def test_nothing_in_the_repo_reads_outside_it():
    """Benchmarks, the package and the tests name files in the repository, never a sibling
    directory of the clone (the development prompts and the corpus ship in the repo)."""
    outside = re.compile(r"""\.\./shared|/ "shared"|"shared" /""")
    files = [*ROOT.glob("adaspec/**/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("tests/*.py")]
    hits = [str(p.relative_to(ROOT)) for p in files if outside.search(p.read_text())]
    assert hits == [] or hits == ["tests/test_docs.py"], hits
