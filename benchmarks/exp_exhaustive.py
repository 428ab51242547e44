"""`exp` over all 2^32 fp32 inputs: the vectorized JIT kernel (adaspec/kernels/jit.py) against
stock mlx's, bit for bit (docs/fast_ops.md, "Exhaustive exp check").

    python benchmarks/exp_exhaustive.py [--chunk-bits 24] [--json docs/results/exp-exhaustive.json]

Ours: the softmax kernel of adaspec/kernels/softmax.py, `exp(x - m)` compiled by mlx's JIT
through the wrapper (AVX/FMA lanes). Stock: mlx's own ops `x - m` then `mx.exp` (libmlx, one
element at a time, `fmaf` calls), which is the arithmetic of softmax.cpp. With m = 0, the
subtraction changes nothing but signalling NaNs (quieted alike on both sides). Every bit of every
output is compared, NaNs included; the script fails (exit 1) on any difference.
"""

import argparse  # noqa: I001  (adaspec must load the BLAS before mlx.core)
import json
import sys
import time

import adaspec  # noqa: F401  (installs the JIT wrapper before mlx compiles anything)
import mlx.core as mx
import numpy as np
from tqdm import tqdm

from adaspec.kernels import jit, softmax


def cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def compare(chunk_bits: int) -> dict:
    size = 1 << chunk_bits
    zero = mx.zeros((1,), mx.float32)
    differ, first = 0, None
    t = time.perf_counter()
    for start in tqdm(range(0, 1 << 32, size), unit="chunk", desc="exp"):
        x = mx.array(np.arange(start, start + size, dtype=np.uint64).astype(np.uint32))
        x = x.view(mx.float32)
        ours = softmax.exp_shifted(x, zero).view(mx.uint32)
        stock = mx.exp(x - zero).view(mx.uint32)
        bad = int(mx.sum(ours != stock).item())
        if bad and first is None:
            i = int(mx.argmax(ours != stock).item())
            first = {
                "input": hex(start + i),
                "ours": hex(ours[i].item()),
                "stock": hex(stock[i].item()),
            }
        differ += bad
    return {
        "inputs": 1 << 32,
        "differing": differ,
        "first_difference": first,
        "seconds": round(time.perf_counter() - t, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk-bits", type=int, default=24, choices=range(16, 29))
    p.add_argument("--json", default=None, help="write the result here")
    a = p.parse_args()
    status = jit.status()
    if not (status and status.active):
        sys.exit(f"the JIT wrapper is not active ({status.reason if status else 'not set up'})")
    result = {
        "mlx": mx.__version__,
        "cpu": cpu_model(),
        "flags": list(jit.FLAGS),
        **compare(a.chunk_bits),
    }
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    sys.exit(1 if result["differing"] else 0)


if __name__ == "__main__":
    main()
