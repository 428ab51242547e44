"""`adaspec bench`: mlx-lm AR against adaspec on a prompt suite, interleaved in one process.

Modules, each importing only those before it: `timing` (one timed run), `suite` (prompt suites,
the shipped one included), `peers` (the peer mechanism: a Peer protocol, each kind's start and
report columns), the kinds `mlx_spec` (mlx-lm's speculative decoding), `stock` (+ its
`stock_worker`: stock mlx-lm in a process of its own) and `llamacpp` (+ `llama_server`:
llama.cpp), `report` (summaries and tables), `runner` (a whole suite), `plot`, `machine`
(the machine's limits as `adaspec doctor` measures them).
"""

from .mlx_spec import PeerConfig, SpecPeer
from .peer_kinds import kinds
from .peers import Peer, PeerKind
from .report import markdown, save, summarize
from .runner import run_suite
from .suite import SHIPPED, Prompt, load_suite
from .timing import Run, timed

__all__ = [
    "SHIPPED",
    "Peer",
    "PeerConfig",
    "PeerKind",
    "Prompt",
    "Run",
    "SpecPeer",
    "kinds",
    "load_suite",
    "markdown",
    "run_suite",
    "save",
    "summarize",
    "timed",
]
