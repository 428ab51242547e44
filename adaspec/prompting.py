"""Turn a prompt or chat messages into token ids the way mlx_lm's CLI does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import GenerationArgumentError


def messages_for(prompt: str, system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system is not None else []
    return [*msgs, {"role": "user", "content": prompt}]


def prompt_ids(tokenizer: Any, messages: Sequence[dict], use_template: bool = True) -> list[int]:
    """Chat template (if the tokenizer has one and it is wanted), then encode without adding
    special tokens a second time; plain text otherwise."""
    if not messages or not any(m.get("content") for m in messages):
        raise GenerationArgumentError(
            "prompt is empty; accepted: at least one message with non-empty content"
        )
    if use_template and getattr(tokenizer, "has_chat_template", False):
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text))
