"""A bench result as one picture: speedup per category against mlx-lm's AR (and mlx-lm's
speculative decoding, when the run had it), decode tok/s per category of adaspec beside mlx-lm's
AR and every peer the run had (stock mlx-lm, llama.cpp, ...), acceptance by draft position, and
the share of plain steps per category (floors, and the steps that timed plain decoding).

`adaspec bench --plot FILE.png` draws it after a run; `python -m adaspec.bench.plot RESULT.json
FILE.png` draws it from a saved `--json` result. matplotlib is an optional extra
(`pip install "adaspec[plot]"`)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from ..errors import AdaspecError
from .peer_kinds import present
from .report import summarize


class PlotError(AdaspecError):
    """The plot cannot be drawn: matplotlib is missing, or the result holds no records."""


def pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise PlotError(
            'plotting needs matplotlib: pip install "adaspec[plot]" (or pip install matplotlib)'
        ) from e
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def category_order(summary: dict, records: list[dict]) -> list[str]:
    """Categories grounded first, each group by falling median speedup."""
    grounded = {r["category"]: r["grounded"] for r in records}
    return sorted(
        summary["by_category"],
        key=lambda c: (not grounded[c], -summary["by_category"][c]["median_speedup"]),
    )


def acceptance_by_position(records: list[dict]) -> list[float]:
    """Mean over prompts of the acceptance at each draft position (prompts whose drafts never
    reached a position do not count for it)."""
    rows = [r.get("acceptance_by_position") or [] for r in records]
    longest = max((len(a) for a in rows), default=0)
    out = []
    for i in range(longest):
        at = [a[i] for a in rows if len(a) > i]
        out.append(statistics.fmean(at))
    return out


def _speedups(ax, cats: list[str], summary: dict, grounded: dict, peer: bool) -> None:
    x = range(len(cats))
    width = 0.4 if peer else 0.7
    colors = ["tab:blue" if grounded[c] else "tab:orange" for c in cats]
    spec = [summary["by_category"][c]["median_speedup"] for c in cats]
    ax.bar([i - width / 2 * peer for i in x], spec, width, color=colors)
    if peer:
        vs = [summary["by_category"][c]["median_spec_vs_peer"] for c in cats]
        ax.bar([i + width / 2 for i in x], vs, width, color=colors, hatch="//", alpha=0.6)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), cats, rotation=35, ha="right")
    ax.set_ylabel("decode speedup (median over prompts)")
    a = summary["all"]
    ax.set_title(
        f"speedup: all {a['median_speedup']:.2f}x, grounded "
        f"{summary['grounded']['median_speedup']:.2f}x, open "
        f"{summary['open']['median_speedup']:.2f}x; identical {a['identical']}/{a['prompts']}"
    )
    from matplotlib.patches import Patch

    keys = [Patch(color="tab:blue", label="grounded, vs mlx-lm AR")]
    keys.append(Patch(color="tab:orange", label="open, vs mlx-lm AR"))
    if peer:
        keys.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="vs mlx-lm spec"))
    ax.legend(handles=keys, loc="upper right")


def rate_series(records: list[dict]) -> list[tuple[str, str]]:
    """(label, record field) of each decode rate the records carry: adaspec, mlx-lm's AR, then
    each peer's."""
    series = [("adaspec", "spec_tok_s"), ("mlx-lm AR", "ar_tok_s")]
    series += [s for report in present(records) for s in report.rates]
    return [(label, key) for label, key in series if records and key in records[0]]


def rates_by_category(records: list[dict], cats: list[str], key: str) -> list[float]:
    """Median over each category's prompts of the record field `key`."""
    return [statistics.median([r[key] for r in records if r["category"] == c]) for c in cats]


def _rates(ax, cats: list[str], records: list[dict]) -> None:
    series = rate_series(records)
    width = 0.8 / max(1, len(series))
    for i, (label, key) in enumerate(series):
        x = [c + (i - (len(series) - 1) / 2) * width for c in range(len(cats))]
        ax.bar(x, rates_by_category(records, cats, key), width, label=label)
    ax.set_xticks(list(range(len(cats))), cats, rotation=35, ha="right")
    ax.set_ylabel("decode tok/s (median over prompts)")
    ax.set_title("decode rate per category, adaspec beside " + ", ".join(s for s, _ in series[1:]))
    ax.legend(loc="upper right", fontsize="small")


def _acceptance(ax, records: list[dict]) -> None:
    for label, rs in (
        ("grounded", [r for r in records if r["grounded"]]),
        ("open", [r for r in records if not r["grounded"]]),
    ):
        acc = acceptance_by_position(rs)
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (mean over prompts)")
    ax.set_ylim(0, 1)
    ax.set_title("acceptance by draft position")
    ax.legend(loc="upper right")


def _floored(ax, cats: list[str], records: list[dict]) -> None:
    def med(c: str, key: str) -> float:
        return statistics.median([r.get(key, 0.0) for r in records if r["category"] == c])

    x = range(len(cats))
    floors = [med(c, "floored_fraction") for c in cats]
    ax.bar(x, floors, 0.7, color="tab:gray", label="floored (a gate, or every arm held)")
    if any("measure_fraction" in r for r in records):
        timing = [med(c, "measure_fraction") for c in cats]
        ax.bar(x, timing, 0.7, bottom=floors, color="silver", label="timing plain decoding")
    ax.set_xticks(list(x), cats, rotation=35, ha="right")
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of steps (median)")
    ax.set_title("plain steps the policy chose")
    ax.legend(loc="upper right")


def plot(result: dict, path: str | Path, title: str | None = None) -> Path:
    """Draw `result` (what `adaspec bench --json` writes: records, summary, config) to `path`."""
    records = result.get("records") or []
    if not records:
        raise PlotError("the result holds no records; accepted: the JSON `adaspec bench` writes")
    summary = summarize(records)
    cats = category_order(summary, records)
    peer = "median_spec_vs_peer" in summary["all"]
    plt = pyplot()
    rates = bool(rate_series(records))
    fig = plt.figure(figsize=(12, 11 if rates else 7.5))
    grid = fig.add_gridspec(2 + rates, 2, height_ratios=(1.2, 1.2, 1)[-(2 + rates) :])
    grounded = {r["category"]: r["grounded"] for r in records}
    _speedups(fig.add_subplot(grid[0, :]), cats, summary, grounded, peer)
    if rates:
        _rates(fig.add_subplot(grid[1, :]), cats, records)
    _acceptance(fig.add_subplot(grid[1 + rates, 0]), records)
    _floored(fig.add_subplot(grid[1 + rates, 1]), cats, records)
    cfg = result.get("config", {})
    fig.suptitle(title or f"{cfg.get('model', '?')}, --drafter {cfg.get('drafter', '?')}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m adaspec.bench.plot RESULT.json FILE.png", file=sys.stderr)
        return 2
    try:
        plot(json.loads(Path(args[0]).read_text()), args[1])
    except (OSError, ValueError, PlotError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
