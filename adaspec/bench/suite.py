"""Prompt suites: JSONL records of chat messages, with a category and whether the answer copies
from the prompt (grounded). One suite ships with adaspec, so the bench runs with no arguments."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import GenerationArgumentError

# written for adaspec: grounded categories (the answer copies from the prompt) and open ones
SHIPPED = Path(__file__).parent / "prompts.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    grounded: bool
    messages: list[dict]
    max_tokens: int


def load_suite(path: str | Path | None = None) -> list[Prompt]:
    """The prompts of the JSONL suite at `path` (None: the suite shipped with adaspec)."""
    p = SHIPPED if path is None else Path(path)
    if not p.is_file():
        raise GenerationArgumentError(f"suite {str(p)!r} does not exist; accepted: a .jsonl file")
    out = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            out.append(
                Prompt(
                    r["id"],
                    r.get("category", "default"),
                    bool(r.get("grounded")),
                    r["messages"],
                    int(r.get("max_tokens", 128)),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise GenerationArgumentError(
                f"{p}:{i} is not a prompt record ({exc!r}); accepted: JSON with id, messages"
            ) from None
    if not out:
        raise GenerationArgumentError(f"suite {str(p)!r} has no prompts")
    return out
