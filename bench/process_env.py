"""The process settings of a bench's sides, alike for megarl and its peer, and their record.

megarl's launcher gives its CPU ranks glibc malloc settings (megarl.host_allocator: no
mmap-backed blocks, no trimming of the heap), worth about 15% of a GRPO step of SmolLM2-135M on
2 cores. A peer that a bench starts in a process of its own (TRL's GRPOTrainer) would run on
glibc's defaults: ``peer_env`` gives it the same variables, as a user of that peer could set them,
and the bench's thread count. The benches give megarl's side the same environment (its launcher
would add the same values where they are missing). Benches whose sides share one process
(train_step, rollout) are alike by construction; ``write_results`` records every bench process's
own settings, and the benches with a peer process record each side's (``process_settings``,
``megarl_rank_settings``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from megarl.host_allocator import CPU_ALLOCATOR_ENV, cpu_allocator_env

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def peer_env(threads: int | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with ``threads`` OMP/MKL threads and, where
    ``base`` does not set them, megarl's CPU malloc settings; without MASTER_PORT (each side's
    job picks its own)."""
    env = dict(os.environ if base is None else base)
    if threads is not None:
        env.update({name: str(threads) for name in THREAD_VARS})
    for key, value in cpu_allocator_env(cuda=False).items():
        env.setdefault(key, value)
    env.pop("MASTER_PORT", None)
    return env


def process_settings(env: Mapping[str, str]) -> dict[str, str | None]:
    """What makes two processes' speeds comparable beyond their code: the glibc malloc variables
    (megarl's and any other ``MALLOC_*`` set) and the thread counts; None where unset."""
    keys = sorted({*CPU_ALLOCATOR_ENV, *THREAD_VARS, *(k for k in env if k.startswith("MALLOC_"))})
    return {key: env.get(key) for key in keys}


def megarl_rank_settings(env: Mapping[str, str]) -> dict[str, str | None]:
    """The settings of the one CPU rank that ``megarl train --nproc-per-node 1`` starts from
    ``env``: what megarl's launcher adds to it (megarl.rank_process_env)."""
    from megarl.rank_process_env import launch_env

    return process_settings(launch_env(env, 1, cuda=False))
