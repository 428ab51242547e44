"""Warm forward time per number of tokens (the cost of a plain step and of verifies), for the
BLAS chosen by ADASPEC_BLAS; numbers for README "Linux CPU: the BLAS matters".

    for b in routed openblas mkl; do ADASPEC_BLAS=$b python benchmarks/forward_cost.py; done
    [--model smollm2-135m] [--context 200] [--sizes 1,2,4,8,11,16] [--repeats 9]
"""

import argparse  # noqa: I001  (adaspec must load the BLAS before mlx.core)
import statistics
import time

import adaspec  # noqa: F401  (loads the BLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from adaspec.kernels import blas
from adaspec.targets.loader import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--sizes", default="1,2,4,8,11,16")
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args()
    model, _ = load(a.model)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[100 + i % 1000 for i in range(a.context)]]), cache=cache))

    def median_ms(n: int) -> float:
        times = []
        for _ in range(a.repeats + 2):  # the first two are warm-up
            x = mx.array([[7] * n])
            t = time.perf_counter()
            mx.eval(model(x, cache=cache))
            times.append(time.perf_counter() - t)
            trim_prompt_cache(cache, n)
        return statistics.median(times[2:]) * 1e3

    sizes = [int(s) for s in a.sizes.split(",")]
    ms = {n: median_ms(n) for n in sizes}
    st = blas.status()
    print(
        f"{st.kind:8s} " + " ".join(f"{n}:{v:.1f}" for n, v in ms.items()) + " ms",
        f"(routed calls kernel/library {blas.routed_calls()})" if blas.routed_calls() else "",
    )


if __name__ == "__main__":
    main()
