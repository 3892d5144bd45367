"""Rank-side bodies of the rollout-scoring test (imported by spawned gloo processes): megatron's
group timeouts, the scoring pass's peak memory as the rollout grows, and the order of a step's
rollout phases seen by a recording rollout engine."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence

import torch

from megarl import parallel
from megarl.rollout.rollout_types import RolloutOutput, SamplingConfig
from megarl.trainer.batch import Samples

# The scoring pass's rollouts: N sequences of a 16-token prompt and a 48-token response, scored
# in micro-batches of at most TOKEN_BUDGET packed tokens (4 sequences).
PROMPT_LEN, RESPONSE_LEN, TOKEN_BUDGET = 16, 48, 256
SIZES = (16, 64)


def group_timeouts_s() -> dict[str, float]:
    """The timeout of this rank's TP, PP and DP groups (seconds), as gloo holds it."""
    groups = {"tp": parallel.tp_group(), "pp": parallel.pp_group(), "dp": parallel.dp_group()}
    cpu = torch.device("cpu")
    return {n: g._get_backend(cpu).options._timeout.total_seconds() for n, g in groups.items()}


def rollout_of(size: int, vocab: int, seed: int) -> Samples:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (size, PROMPT_LEN), generator=gen).tolist()
    responses = torch.randint(1, vocab, (size, RESPONSE_LEN), generator=gen).tolist()
    samples = Samples.from_sequences(prompts, responses, list(range(size)), 0, "cpu")
    samples.tensors.rollout_log_prob = torch.zeros(size, RESPONSE_LEN)
    return samples


def peak_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """Peak bytes of the tensors ``fn`` makes (live tensor storage, as the planner's tests
    measure), and its result."""
    from megarl.plan.measure import live_tensor_tracker

    gc.collect()
    tracker = live_tensor_tracker()
    with tracker:
        out = fn()
    return tracker.peak, out


def scoring_memory(model_dir: str) -> dict:
    """Per rollout size: the scoring pass's peak bytes, and for comparison one forward over the
    whole rollout as one pack (what the hybrid engine used to run before the engine slept); the
    largest difference between their logprobs."""
    from megarl.models.build import build_model
    from megarl.models.logprobs import teacher_forced_log_probs
    from megarl.parallel import ParallelLayout
    from megarl.trainer.model_ops import MicroBatching, response_positions
    from megarl.trainer.old_log_probs import score_old_log_probs

    model, dims = build_model(model_dir, ParallelLayout.for_world(2, pp=2), load=False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    batching = MicroBatching(size=1024, max_tokens=TOKEN_BUDGET, packing=True)
    out: dict = {"scoring": {}, "one_forward": {}, "diff": 0.0}
    for size in SIZES:
        samples = rollout_of(size, dims.vocab_size, seed=size)
        peak, _ = peak_bytes(
            lambda s=samples: score_old_log_probs(
                model, s, dims.vocab_size, 1.0, batching, dims.is_moe
            )
        )
        out["scoring"][size] = peak
        peak, whole = peak_bytes(
            lambda s=samples: teacher_forced_log_probs(
                model, s.input_ids, response_positions(s), dims.vocab_size, seq_lens=s.seq_lens()
            )
        )
        out["one_forward"][size] = peak
        diff = (samples.tensors.require("old_log_prob") - whole).abs().max().item()
        out["diff"] = max(out["diff"], diff)
    return out


class RecordingRollout:
    """A rollout engine that records what the trainer asks of it (and the actor's grad-buffer
    bytes when it generates); its responses are fixed token patterns with logprob -1."""

    def __init__(self, infer_tp: int, vocab: int, events: list, grad_bytes: Callable[[], int]):
        self.infer_tp, self.vocab, self.events, self.grad_bytes = (
            infer_tp,
            vocab,
            events,
            grad_bytes,
        )

    def validate(self, weights) -> None:
        self.events.append(("validate",))

    def update_weights(self, weights) -> None:
        self.events.append(("update_weights", len(list(weights))))

    def after_weight_update(self) -> None:
        self.events.append(("after_weight_update",))

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed_offset: int = 0,
        *,
        seeds: Sequence[int] | None = None,
    ) -> RolloutOutput:
        self.events.append(("generate", self.grad_bytes()))
        out = RolloutOutput()
        for i, prompt in enumerate(prompt_token_ids):
            for j in range(sampling.n):
                length = 3 + (i + j) % sampling.max_new_tokens
                length = min(length, sampling.max_new_tokens)
                ids = [(sum(prompt) + 7 * j + 3 * k) % (self.vocab - 1) + 1 for k in range(length)]
                out.prompt_index.append(i)
                out.token_ids.append(ids)
                out.logprobs.append([-1.0] * length)
                out.finish_reasons.append("stop")
        return out

    def sleep(self) -> None:
        self.events.append(("sleep",))

    def wake_up(self, tags=None) -> None:
        self.events.append(("wake_up", tuple(tags or ())))


def recorded_step_batch(model_dir: str, rank: int) -> dict:
    """One step's batch through the trainer (``step_batch``) with a recording rollout engine in
    the hybrid engine; the events in order (the actor's forwards included, with its grad-buffer
    bytes then), the step's metric names and the scored batch's mismatch."""
    from transformers import AutoTokenizer

    from megarl.config import load_config
    from megarl.data import PromptItem
    from megarl.data.chat import pad_token_id
    from megarl.models.dims import ModelDims
    from megarl.rollout.engine import HybridEngine
    from megarl.run.epochs import EpochBatches
    from megarl.run.startup import Startup, layout_for
    from megarl.trainer.assembly import PolicyRun, mini_batch_rows, role_sections
    from megarl.trainer.colocated_source import ColocatedSource, PolicyData
    from megarl.trainer.experience import RewardSources
    from megarl.trainer.model_ops import MicroBatching
    from megarl.trainer.roles import build_roles
    from megarl.trainer.rollout import step_batch
    from megarl.trainer.rollout_offload import build_actor_memory, build_role_offload
    from megarl.trainer.trajectory_makers import OneReply
    from tests.policy_terms import algorithm_spec

    cfg = load_config(
        overrides=[
            f"model.path={model_dir}",
            "data.train_files=[unused.parquet]",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "actor.micro_batch_size=3",
            "actor.old_log_prob_forward=always",
            "rollout.sampling.n=2",
            "rollout.sampling.max_response_length=6",
            "algorithm.use_kl_loss=false",
            "reward.custom_fn=megarl.rewards.toy:vowel_rate",
            "parallel.pp=2",
        ]
    )
    layout = layout_for(cfg.parallel, 2, with_rollout=True)
    parallel.initialize_model_parallel(layout)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    startup = Startup(layout, rank, tokenizer, pad_token_id(tokenizer) or 0)
    spec = algorithm_spec(cfg, ModelDims.from_pretrained(model_dir).vocab_size)
    roles = build_roles(role_sections(cfg), layout, spec)
    ddp = roles.actor.ddp

    def grad_bytes() -> int:
        return sum(b.grad_data.untyped_storage().nbytes() for b in ddp.buffers)

    events: list = []
    fake = RecordingRollout(layout.rollout_tp, roles.dims.vocab_size, events, grad_bytes)
    roles.actor.model.register_forward_pre_hook(
        lambda module, args: events.append(("forward", grad_bytes()))
    )
    engine = HybridEngine(model_dir, layout, roles.dims, ddp, rollout=fake)
    sampling = SamplingConfig(
        max_new_tokens=cfg.rollout.sampling.max_response_length, n=cfg.rollout.sampling.n
    )
    items = [
        PromptItem(
            uid=i, input_ids=tokenizer(t)["input_ids"], prompt=t, data_source="toy", ground_truth=""
        )
        for i, t in enumerate(["hello there", "count to ten", "a b c", "why?"])
    ]
    rollout = ColocatedSource(
        engine,
        OneReply(),
        PolicyData(None, None, EpochBatches([items], "no prompts")),  # type: ignore[arg-type]
        sampling,
        sampling,
        build_actor_memory(roles, cfg.actor.param_offload),
        build_role_offload(roles, cfg.ref.param_offload, cfg.critic.param_offload),
    )
    run = PolicyRun(
        trainer=cfg.trainer,
        model_path=model_dir,
        mini_batch_rows=mini_batch_rows(cfg.actor, cfg.rollout, layout.dp),
        startup=startup,
        spec=spec,
        roles=roles,
        rollout=rollout,
        rewards=RewardSources.from_config(
            cfg.reward, None, cfg.rollout.sampling.max_response_length, "float32"
        ),
        kl_ctrl=None,
        batching=MicroBatching(
            cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch, cfg.actor.packing
        ),
        tracker=None,  # type: ignore[arg-type]
        resumed=None,  # type: ignore[arg-type]
    )
    batch, m = step_batch(run, cfg.algorithm, cfg.data.train_batch_size)
    old = batch.samples.tensors.require("old_log_prob")[batch.samples.response_mask.bool()]
    return {
        "events": events,
        "metrics": sorted(m),
        "mismatch": {k: v.value for k, v in m.items() if k.startswith("rollout/logprob_diff")},
        "samples": batch.samples.size,
        "old_finite": bool(torch.isfinite(old).all()) and old.numel() > 0,
        "grad_bytes_after": grad_bytes(),
    }


def scoring_worker(rank: int, world: int, config_dir: str, tiny_dir: str) -> dict:
    from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
    from megarl.platform import adapt_megatron_for_cpu
    from megarl.run.watchdog import collective_timeout_s

    adapt_megatron_for_cpu()
    layout = ParallelLayout.for_world(world, pp=2)
    out: dict = {}
    initialize_model_parallel(layout)
    out["default_timeouts"] = group_timeouts_s()
    out["derived_timeout"] = collective_timeout_s(40.0)
    initialize_model_parallel(layout, timeout_s=out["derived_timeout"])
    out["timeouts"] = group_timeouts_s()
    out["memory"] = scoring_memory(config_dir)
    destroy_model_parallel()
    out["recorded"] = recorded_step_batch(tiny_dir, rank)
    destroy_model_parallel()
    return out
