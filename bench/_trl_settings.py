"""GRPOConfig settings that both TRL bench workers share (``_trl_grpo_worker.py``,
``_trl_learn_worker.py``): what makes TRL's run comparable to megarl's.

Imported by the workers inside the TRL virtualenv (no megarl, no TRL import here). The settings:
fp32 on CPU, constant lr without warm-up, AdamW as megarl's defaults, clipping at 1.0, one policy
iteration per generation, no KL term (``beta`` 0), token-level mean loss (TRL's ``dapo``, as
megarl's ``token-mean``), group-normalised rewards, untempered sampling without top-p/top-k, no
checkpoints, no loggers.
"""

from __future__ import annotations

import json
import os


def read_spec(path: str) -> dict:
    """The worker's SPEC.json, with its thread count applied before torch starts its pools."""
    with open(path) as fh:
        spec = json.load(fh)
    threads = int(spec["threads"])
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    return spec


def run_facts() -> dict:
    """What each worker reports about its own run: package versions, torch's thread count and
    the glibc malloc variables and thread counts in its environment (``process_env``)."""
    import torch
    import transformers
    import trl

    return {
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "threads": torch.get_num_threads(),
        "process_env": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith("MALLOC_") or k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
        },
    }


def comparable_grpo_settings(spec: dict, *, num_generations: int, max_steps: int) -> dict:
    """Keyword arguments for ``trl.GRPOConfig`` (the batching and rollout settings are the
    caller's: they differ between the two benches)."""
    return {
        "output_dir": spec["output_dir"],
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "learning_rate": float(spec["lr"]),
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": float(spec["weight_decay"]),
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0,
        "num_generations": num_generations,
        "max_completion_length": int(spec["max_new_tokens"]),
        "num_iterations": 1,
        "beta": 0.0,
        "loss_type": "dapo",  # token-level mean over the batch, like megarl's token-mean
        "scale_rewards": "group",
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "max_steps": max_steps,
        "shuffle_dataset": False,  # the benches order the rows themselves
        "seed": int(spec["seed"]),
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "log_completions": False,
    }
