"""megarl's precision as a bench option (``--dtype``, ``--rollout-dtype``), shared by the benches
that run megarl beside a peer; the peer stays fp32."""

from __future__ import annotations

import argparse


def add_precision_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="megarl's model.dtype (the peer stays fp32)",
    )
    ap.add_argument(
        "--rollout-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="megarl's rollout.engine.dtype (auto: --dtype)",
    )


def results_suffix(args: argparse.Namespace) -> str:
    """The results file's name suffix: none for the default fp32 run, so that a bf16 run never
    overwrites the stored fp32 figures."""
    if args.dtype == "float32" and args.rollout_dtype in ("auto", "float32"):
        return ""
    return f"_{args.dtype}_rollout_{args.rollout_dtype}"
