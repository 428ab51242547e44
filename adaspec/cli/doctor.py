"""`adaspec doctor [--model M] [--json]`: platform, BLAS, GFLOP/s and the verify-cost ratio."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor", help="check BLAS, fp32 speed and (with --model) the verify-cost ratio"
    )
    p.add_argument("--model", default=None, help="model to time: catalogue name, .gguf or folder")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from .. import doctor
    from ..distributed.world import network_report, world

    w = world()  # under mlx.launch / mpirun: every rank measures the network, rank 0 reports
    net = network_report(w)
    w.done()  # no collective follows: the other ranks may leave now
    if not w.leader:
        return 0
    report = doctor.collect(args.model)
    report["distributed"] = net
    print(json.dumps(report, indent=2) if args.json else doctor.format_report(report))
    return 0
