"""What one verify costs on a sharded target: bytes that cross between the ranks (TCP_INFO
counts, rank 0 sent + received), collectives, and wall time per verify of n tokens (a forward
of n rows, read, then rolled back), against the same verify in one process.

    mlx.launch --backend ring -n 2 python benchmarks/distributed_wire.py --json OUT.json
    python benchmarks/distributed_wire.py --json OUT-one.json     # the same in one process
"""

from __future__ import annotations

# isort: off
import adaspec  # noqa: F401  (first: loads the fast BLAS before mlx)

# isort: on
import argparse
import json
import statistics
import time
from pathlib import Path


def measure(target, rows: int, repeats: int, meter) -> dict:
    import mlx.core as mx

    times, wire = [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        b0 = meter()
        t0 = time.perf_counter()
        fwd = target.forward([7] * rows)
        mx.eval(fwd.logits)
        target.rollback(rows)
        times.append(time.perf_counter() - t0)
        b1 = meter()
        wire.append((b1[0] - b0[0], b1[1] - b0[1]))
    times, wire = times[1:], wire[1:]
    return {
        "rows": rows,
        "ms_median": round(statistics.median(times) * 1e3, 2),
        "ms_min": round(min(times) * 1e3, 2),
        "bytes": statistics.median(w[0] for w in wire),
        "collectives": statistics.median(w[1] for w in wire),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from adaspec import settings
    from adaspec.cli.common import load_model
    from adaspec.distributed import run_ranks, target_for
    from adaspec.distributed.shard import sharding
    from adaspec.distributed.world import world

    model, tokenizer = load_model(args.model)

    def body() -> int:
        w = world()
        meter = (lambda: (sum(w.wire_bytes()), w.collectives)) if w.size > 1 else lambda: (0, 0)
        target = target_for(model, tokenizer, settings.get())
        target.prefill(list(range(100, 100 + args.context)))
        rows = [measure(target, int(n), args.repeats, meter) for n in args.rows.split(",")]
        s = sharding(model)
        out = {"model": args.model, "target": s.describe() if s else "one process", "rows": rows}
        print(json.dumps(out, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        return 0

    return run_ranks(model, tokenizer, settings.get().shard, body)


if __name__ == "__main__":
    raise SystemExit(main())
