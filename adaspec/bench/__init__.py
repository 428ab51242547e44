"""`adaspec bench`: mlx-lm AR against adaspec on a prompt suite, interleaved in one process.

Modules, each importing only those before it: `timing` (one timed run), `suite` (prompt suites,
the shipped one included), `peer` (mlx-lm's speculative decoding as a third column), `report`
(summaries and tables), `runner` (a whole suite).
"""

from .peer import PeerConfig
from .report import markdown, save, summarize
from .runner import run_suite
from .suite import SHIPPED, Prompt, load_suite
from .timing import Run, timed

__all__ = [
    "SHIPPED",
    "PeerConfig",
    "Prompt",
    "Run",
    "load_suite",
    "markdown",
    "run_suite",
    "save",
    "summarize",
    "timed",
]
