"""Rank-side body of the Dr. GRPO layout test (imported by spawned gloo processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.config import load_config
from megarl.models.build import build_model
from megarl.models.distributed import OptimSettings, wrap_for_training
from megarl.models.export import iter_stage_hf_tensors
from megarl.parallel import (
    ParallelLayout,
    destroy_model_parallel,
    dp_group,
    dp_rank,
    dp_size,
    initialize_model_parallel,
)
from megarl.platform import adapt_megatron_for_cpu
from megarl.run.trainable import Trainable
from megarl.trainer.batch import Samples
from megarl.trainer.model_ops import MicroBatching, ppo_update
from tests.distributed.random_groups import random_group_samples
from tests.policy_terms import algorithm_spec

MAX_RESPONSE = 12
PROMPTS, N = 4, 4  # 16 sequences, prompt-major: each DP rank holds whole groups


def dr_grpo_config(model_dir: str):
    return load_config(
        overrides=[
            f"model.path={model_dir}",
            "data.train_files=[a.parquet]",
            "algorithm.loss_agg_mode=seq-mean-token-sum-norm",
            "algorithm.norm_adv_by_std=false",
            "algorithm.use_kl_loss=false",
            f"rollout.sampling.max_response_length={MAX_RESPONSE}",
            f"rollout.sampling.n={N}",
        ]
    )


def dr_grpo_batch(vocab: int) -> Samples:
    """Prompts of 3-6 tokens, responses of 1-12 (lengths differ within and across groups), old
    logprobs and one advantage per sequence: the same on every rank."""
    s, gen = random_group_samples(vocab, PROMPTS, N, MAX_RESPONSE, seed=7)
    shape = s.response_mask.shape
    # old logprobs near the model's (~ -log vocab) so that some ratios are clipped
    s.tensors.old_log_prob = -torch.log(torch.tensor(float(vocab))) + 0.3 * torch.randn(
        shape, generator=gen
    )
    s.tensors.advantages = torch.randn(shape[0], 1, generator=gen).expand(shape).clone()
    return s


def dr_grpo_worker(rank: int, world: int, model_dir: str, cases: list[dict]) -> dict[str, dict]:
    """One actor update (PPO clip, seq-mean-token-sum-norm) of the same batch per case (a layout
    and a micro-batch size): the global pg loss, the grad norm, how far the weights moved and
    how far they are from the first case's."""
    adapt_megatron_for_cpu()
    cfg = dr_grpo_config(model_dir)
    # adam_eps 1e-3: Adam's first step divides each grad by its own size, so with 1e-8 float
    # noise on near-zero grads would decide whole steps
    settings = OptimSettings(lr=1e-2, adam_eps=1e-3, clip_grad=1e9, total_steps=1)
    out: dict[str, dict] = {}
    first: dict[str, torch.Tensor] | None = None
    for case in cases:
        layout = ParallelLayout.for_world(world, tp=case["tp"])
        initialize_model_parallel(layout)
        model, dims = build_model(model_dir, layout)
        ddp, optimizer, scheduler = wrap_for_training(model, settings)
        samples = dr_grpo_batch(dims.vocab_size)
        per_rank = samples.size // dp_size()
        mine = samples.select(range(dp_rank() * per_rank, (dp_rank() + 1) * per_rank))
        before = {n: w.clone() for n, w in iter_stage_hf_tensors(ddp, dims, layout)}
        [metrics] = ppo_update(
            Trainable(model, ddp, optimizer, scheduler),
            "actor",
            mine,
            [list(range(mine.size))],
            epochs=1,
            batching=MicroBatching(size=case["micro"]),
            loss_fn=algorithm_spec(cfg, dims.vocab_size).actor_loss,
            token_level=False,
        )
        loss = torch.tensor([metrics["actor/pg_loss"]], dtype=torch.float64)
        dist.all_reduce(loss, group=dp_group())  # DDP averages the ranks' gradients
        key = f"{layout}:micro{case['micro']}"
        after = {n: w.clone() for n, w in iter_stage_hf_tensors(ddp, dims, layout)}
        first = first if first is not None else after
        out[key] = {
            "pg_loss": float(loss.item()) / dp_size(),
            "grad_norm": float(metrics["actor/grad_norm"]),
            "moved": max((after[n] - before[n]).abs().max().item() for n in after),
            # against the first case's update (plain floats travel back, not tensors)
            "weights_vs_first": max((after[n] - first[n]).abs().max().item() for n in after),
            "same_names": float(set(after) == set(first)),
        }
        destroy_model_parallel()
    return out
