"""`adaspec bench --plot`: the picture is drawn from a result's records, and what it draws
(category order, acceptance per position) is computed from them."""

import json
import sys

import pytest

from adaspec.bench import plot as bp
from adaspec.bench.report import summarize


def _record(cid: str, category: str, grounded: bool, speedup: float, acc: list[float]) -> dict:
    return {
        "id": cid,
        "category": category,
        "grounded": grounded,
        "speedup": speedup,
        "e2e_speedup": speedup,
        "tau": 1.5,
        "floored_fraction": 0.1,
        "identical": True,
        "acceptance_by_position": acc,
    }


RECORDS = [
    _record("a", "story", False, 1.2, [0.5, 0.25]),
    _record("b", "repeat", True, 3.0, [0.9, 0.8, 0.7]),
    _record("c", "qa", True, 1.4, [0.6]),
    _record("d", "math", False, 1.5, []),
]


def test_categories_grounded_first_then_by_falling_speedup():
    assert bp.category_order(summarize(RECORDS), RECORDS) == ["repeat", "qa", "math", "story"]


def test_acceptance_per_position_counts_the_prompts_that_reached_it():
    assert bp.acceptance_by_position(RECORDS) == pytest.approx([2.0 / 3, 0.525, 0.7])
    assert bp.acceptance_by_position([]) == []


def test_a_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    out = bp.plot(
        {"records": RECORDS, "config": {"model": "m", "drafter": "pld"}}, tmp_path / "x.png"
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_the_module_draws_a_saved_result(tmp_path):
    pytest.importorskip("matplotlib")
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"records": RECORDS, "summary": {}, "config": {}}))
    assert bp.main([str(src), str(tmp_path / "y.png")]) == 0
    assert (tmp_path / "y.png").is_file()
    assert bp.main([str(src)]) == 2


def test_no_records_is_an_error_naming_what_is_accepted(tmp_path):
    with pytest.raises(bp.PlotError, match="no records.*adaspec bench"):
        bp.plot({"records": []}, tmp_path / "z.png")


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(bp.PlotError, match=r"adaspec\[plot\]"):
        bp.pyplot()
