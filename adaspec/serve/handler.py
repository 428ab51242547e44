"""mlx-lm's APIHandler with what `adaspec serve` adds: the `drafter` request field, stricter
limits (max_tokens within the context), 400 for a bad request found while it is prepared, and
the speculation figures in `usage.adaspec`."""

from __future__ import annotations

import json
from typing import Any

from mlx_lm.server import APIHandler

from .generator import MAX_TOKENS_UNKNOWN_CONTEXT, SpecResponseGenerator, context_length

RETRY_AFTER_S = 1  # seconds a client told 503 is asked to wait


def check_drafter(spec: str) -> None:
    """Raise ValueError naming `drafter` unless `spec` can become a drafter plan (drafters.arms:
    its syntax, drafter names and arguments; `auto` is expanded when the request is served)."""
    from ..drafters.arms import check

    try:
        check(spec)
    except ValueError as e:
        raise ValueError(f"drafter={spec!r} is invalid: {e}") from None


class SpecAPIHandler(APIHandler):
    response_generator: SpecResponseGenerator  # the one `serve.run` hands mlx-lm's server
    _request: Any = None

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        self.drafter = self.body.get("drafter")
        self._validate("drafter", str, optional=True)
        if self.drafter is not None:
            check_drafter(self.drafter)
        model = self.response_generator.model_provider.model
        limit = (context_length(model) if model is not None else None) or (
            MAX_TOKENS_UNKNOWN_CONTEXT
        )
        self._validate("max_tokens", int, min_val=1, max_val=limit)
        if self.xtc_probability:
            raise ValueError(
                f"xtc_probability={self.xtc_probability} is not supported by adaspec serve; "
                "accepted: 0"
            )
        if self.requested_draft_model != "default_model":
            raise ValueError(
                f"draft_model={self.requested_draft_model!r} is not read by adaspec serve; "
                "accepted: drafter, e.g. 'draft-model:PATH'"
            )

    # mlx-lm's CompletionRequest has no field for the drafter: it rides on the instance, and the
    # generator reads it back with getattr (as it sets, and the handler reads, `bad` and `usage`)
    def handle_chat_completions(self) -> Any:
        request = super().handle_chat_completions()
        setattr(request, "drafter", self.drafter)  # noqa: B010
        return request

    def handle_text_completions(self) -> Any:
        request = super().handle_text_completions()
        setattr(request, "drafter", self.drafter)  # noqa: B010
        return request

    def handle_completion(self, request: Any, stop_words: list[str]) -> None:
        self._request = request
        gen = self.response_generator
        if gen.decoding >= gen.concurrency and gen.waiting() >= gen.queue_limit:
            self._busy(gen)
            return
        super().handle_completion(request, stop_words)

    def _busy(self, gen: SpecResponseGenerator) -> None:
        """503 with Retry-After: every slot is taken and the queue is full."""
        body = json.dumps(
            {"error": f"server busy: {gen.waiting()} requests waiting (ADASPEC_SERVE_QUEUE="
             f"{gen.queue_limit}); retry later"}
        ).encode()  # fmt: skip
        self._set_completion_headers(503)
        self.send_header("Retry-After", str(RETRY_AFTER_S))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _set_completion_headers(self, status_code: int = 200) -> None:
        # mlx-lm answers any error raised while a request is prepared with 404; ours are 400
        if status_code == 404 and getattr(self._request, "bad", False):
            status_code = 400
        super()._set_completion_headers(status_code)

    def _with_spec(self, response: dict) -> dict:
        figures = getattr(self._request, "usage", None)
        if "usage" in response and figures is not None:
            response["usage"]["adaspec"] = figures
        return response

    def generate_response(self, *args: Any, **kwargs: Any) -> dict:
        return self._with_spec(super().generate_response(*args, **kwargs))

    def completion_usage_response(self, *args: Any, **kwargs: Any) -> dict:
        return self._with_spec(super().completion_usage_response(*args, **kwargs))
