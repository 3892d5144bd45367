"""Rank-side body of the old-logprob test (imported by spawned gloo processes): one actor update
of the same batch with the old logprobs from a separate forward, and from the update's own."""

from __future__ import annotations

import torch

from megarl.config import load_config
from megarl.models.build import build_model
from megarl.models.distributed import OptimSettings, wrap_for_training
from megarl.models.export import iter_stage_hf_tensors
from megarl.models.logprobs import teacher_forced_log_probs
from megarl.parallel import (
    ParallelLayout,
    destroy_model_parallel,
    dp_rank,
    dp_size,
    initialize_model_parallel,
)
from megarl.platform import adapt_megatron_for_cpu
from megarl.rollout.mismatch import logprob_mismatch
from megarl.run.trainable import Trainable
from megarl.trainer.batch import Samples
from megarl.trainer.losses import sampling_temperature
from megarl.trainer.model_ops import MicroBatching, ppo_update, response_positions
from megarl.trainer.old_log_probs import old_log_prob_from_update, rollout_mismatch
from tests.distributed.random_groups import random_group_samples
from tests.policy_terms import algorithm_spec

PROMPTS, N, MAX_RESPONSE = 4, 4, 10


def one_step_config(model_dir: str, mode: str):
    return load_config(
        overrides=[
            f"model.path={model_dir}",
            "data.train_files=[a.parquet]",
            f"data.train_batch_size={PROMPTS}",
            f"actor.ppo_mini_batch_size={PROMPTS}",
            f"rollout.sampling.n={N}",
            f"rollout.sampling.max_response_length={MAX_RESPONSE}",
            "rollout.sampling.temperature=0.7",
            "algorithm.use_kl_loss=false",
            f"actor.old_log_prob_forward={mode}",
        ]
    )


def rollout_batch(vocab: int) -> Samples:
    """16 sequences (prompts of 3-6 tokens, responses of 1-10), one advantage per sequence, and
    the rollout engine's logprobs stood in for by noise (the actor's are added once known)."""
    s, gen = random_group_samples(vocab, PROMPTS, N, MAX_RESPONSE, seed=11)
    shape = s.response_mask.shape
    s.tensors.advantages = torch.randn(shape[0], 1, generator=gen).expand(shape).clone()
    s.tensors.rollout_log_prob = 0.01 * torch.randn(shape, generator=gen)  # the noise
    return s


def separate_forward(model, samples: Samples, vocab: int, temperature: float) -> torch.Tensor:
    """The old logprobs as the hybrid engine scores a rollout: one forward-only pass over the
    whole batch as one pack, at the response positions."""
    return teacher_forced_log_probs(
        model,
        samples.input_ids,
        response_positions(samples),
        vocab,
        temperature,
        seq_lens=samples.seq_lens(),
    )


def both(runs: dict[str, dict], key: str) -> tuple[float | None, float | None]:
    """A metric of the separate-forward and the update-logprob runs; the loss's metrics exist on
    the last pipeline stage only (None elsewhere)."""
    return runs["always"]["metrics"].get(key), runs["auto"]["metrics"].get(key)


def old_log_prob_worker(rank: int, world: int, model_dir: str, pps: list[int]) -> dict[str, dict]:
    """Per layout (PP over the 2 ranks, or DP2) and mode: the update's pg loss, grad norm and
    updated weights, the old logprobs it used and the rollout mismatch metrics."""
    adapt_megatron_for_cpu()
    # adam_eps 1e-3: with 1e-8 Adam's first step would amplify float noise on near-zero grads
    settings = OptimSettings(lr=1e-2, adam_eps=1e-3, clip_grad=1e9, total_steps=1)
    out: dict[str, dict] = {}
    for pp in pps:
        layout = ParallelLayout.for_world(world, pp=pp)
        initialize_model_parallel(layout)
        runs = {}
        for mode in ("always", "auto"):
            cfg = one_step_config(model_dir, mode)
            model, dims = build_model(model_dir, layout)
            ddp, optimizer, scheduler = wrap_for_training(model, settings)
            samples = rollout_batch(dims.vocab_size)
            per_rank = samples.size // dp_size()
            mine = samples.select(range(dp_rank() * per_rank, (dp_rank() + 1) * per_rank))
            temperature = sampling_temperature(cfg.rollout.sampling.temperature)
            # the rollout engine's logprobs: near the actor's, as vLLM's are
            actor = separate_forward(ddp, mine, dims.vocab_size, temperature)
            mine.tensors.rollout_log_prob = actor + mine.tensors.require("rollout_log_prob")
            from_update = old_log_prob_from_update(
                cfg.algorithm, cfg.actor, cfg.data.train_batch_size
            )
            if not from_update:
                mine.tensors.old_log_prob = actor
            before = {n: w.clone() for n, w in iter_stage_hf_tensors(ddp, dims, layout)}
            [metrics] = ppo_update(
                Trainable(model, ddp, optimizer, scheduler),
                "actor",
                mine,
                [list(range(mine.size))],
                epochs=1,
                batching=MicroBatching(size=3),
                loss_fn=algorithm_spec(cfg, dims.vocab_size).actor_loss,
                token_level=True,
                keep="old_log_prob" if from_update else None,
            )
            if from_update:
                mismatch = rollout_mismatch(mine, dims.is_moe)
            else:
                mask = mine.response_mask.bool()
                diffs = (mine.tensors.require("rollout_log_prob") - actor).abs()[mask]
                mismatch = logprob_mismatch(diffs, dims.is_moe)
            after = {n: w.clone() for n, w in iter_stage_hf_tensors(ddp, dims, layout)}
            runs[mode] = {
                "from_update": from_update,
                "metrics": metrics,
                "mismatch": mismatch,
                "old": mine.tensors.require("old_log_prob") * mine.response_mask,
                "before": before,
                "after": after,
            }
        always, auto = runs["always"], runs["auto"]

        out[str(layout)] = {
            "from_update": (always["from_update"], auto["from_update"]),
            "pg_loss": both(runs, "actor/pg_loss"),
            "grad_norm": both(runs, "actor/grad_norm"),
            "ratio_max": both(runs, "actor/ratio_max"),
            "mismatch": (always["mismatch"], auto["mismatch"]),
            "old_diff": (always["old"] - auto["old"]).abs().max().item(),
            "same_start": max(
                (always["before"][n] - auto["before"][n]).abs().max().item()
                for n in always["before"]
            ),
            "moved": max(
                (auto["after"][n] - auto["before"][n]).abs().max().item() for n in auto["after"]
            ),
            "weights_diff": max(
                (always["after"][n] - auto["after"][n]).abs().max().item() for n in auto["after"]
            ),
        }
        destroy_model_parallel()
    return out
