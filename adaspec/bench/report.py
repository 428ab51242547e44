"""Summaries of bench records (by category, grounded and open, overall), as JSON and as a
markdown table."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

from .peer_kinds import present, report_blocks
from .timing import median


def summarize(records: list[dict]) -> dict:
    def block(rs: list[dict]) -> dict:
        return {
            "prompts": len(rs),
            "median_ar_tok_s": round(median([r["ar_tok_s"] for r in rs if "ar_tok_s" in r]), 2),
            "median_spec_tok_s": round(
                median([r["spec_tok_s"] for r in rs if "spec_tok_s" in r]), 2
            ),
            "median_speedup": round(median([r["speedup"] for r in rs]), 4),
            "min_speedup": round(min((r["speedup"] for r in rs), default=0.0), 4),
            "median_e2e_speedup": round(median([r["e2e_speedup"] for r in rs]), 4),
            "mean_tau": round(statistics.fmean([r["tau"] for r in rs]), 4) if rs else 0.0,
            "floored_fraction": round(median([r["floored_fraction"] for r in rs]), 4),
            "identical": sum(r["identical"] for r in rs),
            **report_blocks(rs),
            **wire_block(rs),
        }

    cats = sorted({r["category"] for r in records})
    return {
        "all": block(records),
        "grounded": block([r for r in records if r["grounded"]]),
        "open": block([r for r in records if not r["grounded"]]),
        "by_category": {c: block([r for r in records if r["category"] == c]) for c in cats},
    }


def wire_block(rs: list[dict]) -> dict:
    """Sharded target: medians over prompts of what crossed the network per target step and
    per token, for mlx-lm's AR and adaspec (empty for one process)."""
    rs = [r for r in rs if "wire" in r]
    if not rs:
        return {}
    return {
        f"{k}_{side}": round(median([r["wire"][side][k] for r in rs]), 2)
        for side in ("ar", "spec")
        for k in ("bytes_per_step", "collectives_per_step", "bytes_per_token")
    }


def wire_lines(summary: dict) -> list[str]:
    b = summary["all"]
    if "bytes_per_step_ar" not in b:
        return []
    return [
        "",
        "| across ranks (median) | bytes / step | collectives / step | bytes / token |",
        "|---|---|---|---|",
        *(
            f"| {name} | {b['bytes_per_step_' + side]:.0f} | "
            f"{b['collectives_per_step_' + side]:.2f} | {b['bytes_per_token_' + side]:.0f} |"
            for name, side in (("mlx-lm AR", "ar"), ("adaspec", "spec"))
        ),
    ]


def markdown(records: list[dict], summary: dict) -> str:
    """The summary as a markdown table: a row per category, then grounded, open and all; each
    peer's columns after adaspec's."""
    columns = [c for report in present(records) for c in report.columns]
    head = "| category | prompts | AR tok/s | spec tok/s | speedup (median) | min | tau | floored "
    head += "| identical |" + "".join(f" {c.header} |" for c in columns)
    lines = [head, "|---" * (9 + len(columns)) + "|"]

    def row(name: str, b: dict, rs: list[dict], bold: bool) -> str:
        ar = median([r["ar_tok_s"] for r in rs])
        sp = median([r["spec_tok_s"] for r in rs])
        speedup = f"{b['median_speedup']:.2f}x"
        cells = [
            f"**{name}**" if bold else name,
            str(b["prompts"]),
            f"{ar:.1f}",
            f"{sp:.1f}",
            f"**{speedup}**" if bold else speedup,
            f"{b['min_speedup']:.2f}x",
            f"{b['mean_tau']:.2f}",
            f"{b['floored_fraction']:.0%}",
            f"{b['identical']}/{b['prompts']}",
            *(c.cell(b, rs) for c in columns),
        ]
        return "| " + " | ".join(cells) + " |"

    for cat, b in summary["by_category"].items():
        lines.append(row(cat, b, [r for r in records if r["category"] == cat], False))
    for name in ("grounded", "open", "all"):
        rs = [r for r in records if name == "all" or r["grounded"] == (name == "grounded")]
        if summary[name]["prompts"]:
            lines.append(row(name, summary[name], rs, True))
    return "\n".join(lines + wire_lines(summary))


def save(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2, default=lambda o: asdict(o)))
