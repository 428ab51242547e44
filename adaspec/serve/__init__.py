"""`adaspec serve`: mlx-lm's OpenAI-compatible server (request parsing, chat templates, tool
calls, HTTP) with generation replaced by adaspec's speculative decoder and prompt caches."""

from __future__ import annotations

from .generator import CachePool, SpecResponseGenerator
from .handler import SpecAPIHandler, check_drafter

__all__ = ["CachePool", "SpecAPIHandler", "SpecResponseGenerator", "check_drafter", "run"]


def run(host: str, port: int, provider, drafter: str) -> None:
    """Serve like `mlx_lm.server.run` until interrupted (one process, no distributed mode)."""
    from mlx_lm.server import _run_http_server

    from ..settings import get

    s = get()
    args = provider.cli_args
    pool = CachePool(args.prompt_cache_size, args.prompt_cache_bytes)
    generator = SpecResponseGenerator(provider, pool, drafter, s.serve_concurrency, s.serve_queue)
    _run_http_server(host, port, generator, handler_class=SpecAPIHandler)
