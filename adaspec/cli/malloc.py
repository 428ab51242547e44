"""The command line's process runs with a larger per-thread cache in glibc's allocator.

mlx allocates and frees small objects for every graph node (the node itself, its dispatch to
the stream thread, its buffers' bookkeeping), on two threads: a decode step of a small model
is thousands of them. With glibc's default per-thread cache (7 chunks of each size) most go to
the shared arena and its consolidation; with `ADASPEC_MALLOC_TCACHE` chunks per size
(default 1000) they stay in the thread's cache. glibc reads the size only at process start
(the `glibc.malloc.tcache_count` tunable in GLIBC_TUNABLES), so `adaspec` starts itself once
more with it set. Allocation never changes a computed value; set the variable to 0 to leave
the allocator as it is, or set GLIBC_TUNABLES yourself (then it is left alone).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.tcache_count"
VARIABLE = "GLIBC_TUNABLES"


def tuned_environment(env: Mapping[str, str], count: int) -> dict[str, str] | None:
    """`env` with the tcache tunable added, or None when there is nothing to add (count 0,
    or the tunable already set by the user or by an earlier start)."""
    current = env.get(VARIABLE, "")
    if count <= 0 or TUNABLE in current:
        return None
    entry = f"{TUNABLE}={count}"
    return {**env, VARIABLE: f"{current}:{entry}" if current else entry}


def restart_tuned(count: int) -> None:
    """Replace this process with the same command line under the tuned allocator (Linux with
    glibc only; returns when there is nothing to do)."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return
    env = tuned_environment(os.environ, count)
    if env is None:
        return
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
