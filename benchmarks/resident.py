"""Resident memory of a loaded model, with its weights at their stored bits and as the fp32
expansion: each setting in a fresh process, which loads the model, decodes 32 tokens with
mlx-lm and reports its peak and current resident set.

    python benchmarks/resident.py [--model smollm2-135m] [--json out.json]
"""

import argparse
import json
import os
import subprocess
import sys
from datetime import date

CHILD = """
import resource, adaspec
from mlx_lm import generate
model, tok = adaspec.load({model!r})
generate(model, tok, "Write a haiku about rivers.", max_tokens=32)
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
stored = getattr(model, "adaspec_stored", None)
print(rss / 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
      stored.nbytes / 2**20 if stored else 0)
"""


def measure(model: str, stored: str) -> dict[str, float]:
    env = {**os.environ, "ADASPEC_STORED_WEIGHTS": stored}
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(model=model)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    rss, peak, weights = (float(x) for x in out.stdout.split()[-3:])
    return {"rss_mb": rss, "peak_mb": peak, "stored_weights_mb": weights}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    res = {mode: measure(a.model, mode) for mode in ("on", "off")}
    for mode, r in res.items():
        name = "stored bits" if mode == "on" else "fp32 expansion"
        print(f"{a.model} {name:15s} resident {r['rss_mb']:7.0f} MB, peak {r['peak_mb']:7.0f} MB")
    print(f"stored / fp32: {res['on']['rss_mb'] / res['off']['rss_mb']:.2f}x resident")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": date.today().isoformat(), "model": a.model, **res}, f, indent=1)


if __name__ == "__main__":
    main()
