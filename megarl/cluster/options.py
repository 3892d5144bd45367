"""The launcher options of ``megarl train`` / ``train-rm`` (beside ``--nproc-per-node``)."""

from __future__ import annotations

import argparse

LAUNCHERS = ("torchrun", "ray", "slurm")


def add_launcher_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="torchrun",
        help="torchrun: local processes (or srun's tasks under Slurm); ray: one Ray actor per "
        "rank on a Ray cluster (docs/ray.md); slurm: one srun step per attempt, from the batch "
        "script of an allocation (docs/slurm.md)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="--launcher ray: auto (the cluster started on this machine) or HOST:PORT of a "
        "cluster's head; default: RAY_ADDRESS if set, else a new local Ray instance",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="--launcher ray or slurm: nodes; the job has nnodes x nproc-per-node ranks "
        "(default: ray 1, slurm the allocation's nodes); --dry-run: the nodes it plans for",
    )
