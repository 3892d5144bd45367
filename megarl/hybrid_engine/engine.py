"""The 3D-HybridEngine: the actor trains in megatron's TP x PP x DP layout and rolls out in vLLM's.

The trainer's loop reads as two transitions around generation::

    engine.to_rollout()                  # free grads (and offload optimizer state on GPUs),
                                         # reshard weights bucket by bucket into vLLM, wake vLLM
    batch = engine.generate(prompts, sampling)
    engine.to_train()                    # vLLM sleeps, training memory comes back

Resharding follows a pure plan (:mod:`megarl.hybrid_engine.plan`) computed identically on every
rank; the executor (:mod:`megarl.hybrid_engine.execute`) moves each bucket and hands it to vLLM in
Hugging Face layout. Rollout prompts: each training DP rank passes its own prompts; they are spread
over the ``world / infer_tp`` vLLM engines and every rank gets back the responses of its DP rank,
scored by the actor (teacher-forced logprobs) so the rollout-trainer mismatch is measured on every
rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.hybrid_engine.execute import (
    ReshardExecutor,
    ReshardStats,
    hf_output_shapes,
    local_spec_tensors,
)
from megarl.hybrid_engine.plan import actor_tensor_specs, plan_reshard
from megarl.hybrid_engine.vllm_rollout import (
    EngineConfig,
    RolloutOutput,
    SamplingConfig,
    VLLMRollout,
    checkpoint_shapes,
)
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout


@dataclass
class RolloutBatch:
    """This DP rank's prompts and responses (sample j of prompt i at ``i * n + j``)."""

    prompts: list[list[int]]
    output: RolloutOutput
    # [samples, max_len - 1] teacher-forced actor logprobs of sequence tokens 1.. (prompt+response,
    # right padded); the response part starts at len(prompt) - 1.
    actor_logprobs: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def sequences(self) -> list[list[int]]:
        return [
            list(self.prompts[i]) + list(r)
            for i, r in zip(self.output.prompt_index, self.output.token_ids, strict=True)
        ]

    def response_actor_logprobs(self) -> list[torch.Tensor]:
        """Per sample, the actor's logprob of each response token."""
        assert self.actor_logprobs is not None
        out = []
        for row, (i, r) in enumerate(
            zip(self.output.prompt_index, self.output.token_ids, strict=True)
        ):
            start = len(self.prompts[i]) - 1
            out.append(self.actor_logprobs[row, start : start + len(r)])
        return out


def check_rollout_model(
    produced: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], tied: bool
) -> None:
    """The reshard output must be exactly the rollout model's tensors (names and shapes)."""
    for name, shape in produced.items():
        if name not in expected:
            raise ValueError(
                f"reshard plan produces {name!r}, which the rollout model does not have"
            )
        if tuple(expected[name]) != tuple(shape):
            raise ValueError(
                f"reshard plan produces {name!r} with shape {list(shape)} but the rollout model "
                f"expects {list(expected[name])}"
            )
    missing = [n for n in expected if n not in produced and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"reshard plan does not produce the rollout model's tensor {missing[0]!r}")


class HybridEngine:
    """Owns the actor's rollout engine and the transitions between training and rollout."""

    def __init__(
        self,
        model_dir: str | Path,
        layout: ParallelLayout,
        dims: ModelDims,
        actor,
        optimizer=None,
        *,
        engine_config: EngineConfig | None = None,
        bucket_bytes: int = 256 << 20,
        rollout: VLLMRollout | None = None,
    ):
        from megatron.core import parallel_state as ps

        from megarl.models.build import layer_offset

        layout.check_rollout()
        self.layout = layout
        self.dims = dims
        self.actor = actor
        self.optimizer = optimizer
        self.rank = dist.get_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self._layer_offset = layer_offset(dims, layout, self.pp_rank)
        itemsize = next(actor.parameters()).element_size()
        specs = actor_tensor_specs(dims, layout.layers_per_stage(dims.num_layers), itemsize)
        # vLLM's CPU and CUDA builds both load HF-layout tensors: full mode (every rank gets whole
        # tensors, vLLM cuts its shard). "shard" mode plans the zero-redundancy transition for
        # engines that accept pre-sharded tensors.
        self.plan = plan_reshard(
            specs, layout.tp, layout.pp, layout.dp, layout.rollout_tp, bucket_bytes, mode="full"
        )
        self.executor = ReshardExecutor(self.plan, dims, self.rank)
        self.hf_shapes = hf_output_shapes(self.plan, dims)
        expected = checkpoint_shapes(model_dir)
        check_rollout_model(self.hf_shapes, expected, dims.tie_word_embeddings)
        if rollout is not None and rollout.infer_tp != layout.rollout_tp:
            raise ValueError(
                f"the given rollout engine has infer_tp={rollout.infer_tp}, the layout "
                f"{layout.rollout_tp}"
            )
        # One engine per process: a later HybridEngine (e.g. another training layout) reuses it.
        self.rollout = rollout or VLLMRollout(
            model_dir, layout.rollout_tp, engine_config, expected_shapes=expected
        )
        self.last_reshard: ReshardStats | None = None
        self._grads_freed = False
        self._optimizer_offloaded = False
        self._rollouts = 0
        self.metrics: dict[str, float] = {}

    @property
    def rollout_count(self) -> int:
        """Rollouts generated so far; request seeds depend on it, so a resumed run restores it."""
        return self._rollouts

    @rollout_count.setter
    def rollout_count(self, value: int) -> None:
        self._rollouts = int(value)

    # -- transitions ---------------------------------------------------------------------------
    def to_rollout(self) -> dict[str, float]:
        """Free training-only memory, reshard the actor into vLLM, wake vLLM up."""
        self.rollout.validate(list(self.hf_shapes.items()))  # before anything is loaded
        freed = self._free_grads()
        self._offload_optimizer()
        self.rollout.wake_up(["weights"])
        local = local_spec_tensors(self.actor, self.dims, self._layer_offset, self.plan.specs)
        stats = self.executor.run(local, self.rollout.update_weights)
        del local
        self.rollout.after_weight_update()
        self.rollout.wake_up(["kv_cache"])
        self.last_reshard = stats
        self.metrics = {**stats.as_metrics(), "hybrid/grad_bytes_freed": float(freed)}
        return dict(self.metrics)

    def to_train(self) -> None:
        """Put vLLM to sleep and bring grads (and optimizer state) back."""
        self.rollout.sleep()
        self._restore_grads()
        self._onload_optimizer()

    def _grad_buffers(self):
        return list(getattr(self.actor, "buffers", [])) + list(
            getattr(self.actor, "expert_parallel_buffers", [])
        )

    def _free_grads(self) -> int:
        """Release megatron DDP's grad buffers (zeroed at the next step anyway)."""
        if self._grads_freed:
            return 0
        freed = 0
        for buf in self._grad_buffers():
            storage = buf.grad_data.untyped_storage()
            freed += storage.nbytes()
            storage.resize_(0)
        self._grads_freed = bool(self._grad_buffers())
        return freed

    def _restore_grads(self) -> None:
        if not self._grads_freed:
            return
        for buf in self._grad_buffers():
            data = buf.grad_data
            data.untyped_storage().resize_(data.numel() * data.element_size())
            data.zero_()
        self._grads_freed = False

    def _optimizer_state_tensors(self):
        inner = getattr(self.optimizer, "optimizer", None)
        if inner is None or not hasattr(inner, "state"):
            return []
        return [
            (state, key)
            for state in inner.state.values()
            for key, value in state.items()
            if isinstance(value, torch.Tensor)
        ]

    def _offload_optimizer(self) -> None:
        """GPU: move Adam moments to host memory during rollout. CPU: nothing to gain."""
        if not torch.cuda.is_available() or self._optimizer_offloaded:
            return
        for state, key in self._optimizer_state_tensors():
            state[key] = state[key].to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._optimizer_offloaded = True

    def _onload_optimizer(self) -> None:
        if not self._optimizer_offloaded:
            return
        device = torch.device("cuda", torch.cuda.current_device())
        for state, key in self._optimizer_state_tensors():
            state[key] = state[key].to(device, non_blocking=True)
        torch.cuda.synchronize()
        self._optimizer_offloaded = False

    # -- rollout -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        score_with_actor: bool = True,
    ) -> RolloutBatch:
        """Responses for this DP rank's prompts (identical on all ranks of a DP rank).

        The prompts of all DP ranks are split over the vLLM engines; request seeds depend only on
        the global prompt index and the rollout count, so samples do not depend on the layout.
        With ``score_with_actor`` the actor's teacher-forced logprobs come back too (usable as the
        old logprobs) and the mismatch with vLLM's is in ``batch.metrics``.
        """
        world = dist.get_world_size()
        mine = [list(map(int, p)) for p in prompts]
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (self.dp_rank, mine))
        per_dp: dict[int, list[list[int]]] = {}
        for d, p in gathered:
            per_dp.setdefault(d, p)
        order = sorted(per_dp)
        offsets, all_prompts = {}, []
        for d in order:
            offsets[d] = len(all_prompts)
            all_prompts += per_dp[d]
        engines = self.layout.rollout_dp
        engine = self.rank // self.layout.rollout_tp
        lo = engine * len(all_prompts) // engines
        hi = (engine + 1) * len(all_prompts) // engines
        seed_offset = lo + self._rollouts * max(1, len(all_prompts))
        self._rollouts += 1
        out = self.rollout.generate(all_prompts[lo:hi], sampling, seed_offset=seed_offset)
        results: list = [None] * world
        dist.all_gather_object(results, (engine, lo, out))
        merged = RolloutOutput()
        seen = set()
        for e, start, o in sorted(results, key=lambda x: x[0]):
            if e not in seen:
                seen.add(e)
                merged.extend(o, index_offset=start)
        a, b = offsets[self.dp_rank], offsets[self.dp_rank] + len(mine)
        keep = [k for k, i in enumerate(merged.prompt_index) if a <= i < b]
        output = RolloutOutput(
            prompt_index=[merged.prompt_index[k] - a for k in keep],
            token_ids=[merged.token_ids[k] for k in keep],
            logprobs=[merged.logprobs[k] for k in keep],
            finish_reasons=[merged.finish_reasons[k] for k in keep],
        )
        batch = RolloutBatch(prompts=mine, output=output)
        if score_with_actor:
            starts = [len(batch.prompts[i]) - 1 for i in batch.output.prompt_index]
            # vLLM returns the logprobs of the distribution it sampled from (logits / temperature):
            # the actor scores the same one, so the mismatch compares like with like.
            temperature = sampling.temperature if sampling.temperature > 0 else 1.0
            batch.actor_logprobs = self.actor_logprobs(
                batch.sequences(), starts=starts, temperature=temperature
            )
            batch.metrics = self.logprob_mismatch(batch)
            self.metrics.update(batch.metrics)
        return batch

    @torch.no_grad()
    def actor_logprobs(
        self,
        sequences: list[list[int]],
        pad_id: int = 0,
        starts: list[int] | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """Teacher-forced logprobs of tokens 1.. of each (right-padded) sequence, ``[N, L-1]``, on
        every rank, under ``softmax(logits / temperature)``. With ``starts`` only positions
        ``starts[i]..`` of row i are computed (the response: the output layer skips the prompt);
        the others are 0."""
        from megatron.core import parallel_state as ps

        from megarl.algos import vocab_parallel_log_probs
        from megarl.models.forward import run_schedule

        length = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
        for row, s in enumerate(sequences):
            ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        first = torch.tensor(starts if starts is not None else [0] * len(sequences))
        width = length - 1 - int(first.min())
        positions = (first.unsqueeze(1) + torch.arange(width)).clamp(max=length - 2)
        targets = ids.gather(1, positions + 1)
        device = next(self.actor.parameters()).device
        tp_group = ps.get_tensor_model_parallel_group() if self.layout.tp > 1 else None

        def logprobs(logits_shard, batch):
            # chunked over the vocabulary shard: no gathered or log-softmaxed [b, P, V] copy
            if temperature != 1.0:
                logits_shard = logits_shard / temperature
            logp = vocab_parallel_log_probs(
                logits_shard, targets.to(device), tp_group, vocab_size=self.dims.vocab_size
            )
            return logits_shard.new_zeros(()), {"logp": logp.float()}

        outs = run_schedule(
            [self.actor],
            [{"input_ids": ids.to(device), "positions": positions}],
            logprobs,
            forward_only=True,
        )
        out = torch.zeros(len(sequences), length - 1, dtype=torch.float32, device=device)
        if outs:
            out.scatter_(1, positions.to(device), outs[0]["logp"])
        if self.layout.pp > 1:
            group = ps.get_pipeline_model_parallel_group()
            last = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast(out, src=last, group=group)
        return out

    def logprob_mismatch(self, batch: RolloutBatch) -> dict[str, float]:
        """Mean and max |vLLM - actor| logprob over response tokens, over the whole world."""
        diffs = [
            (torch.tensor(v, dtype=torch.float32) - a.float().cpu()).abs()
            for v, a in zip(batch.output.logprobs, batch.response_actor_logprobs(), strict=True)
        ]
        flat = torch.cat(diffs) if diffs else torch.zeros(0)
        sums = torch.tensor([flat.sum().item(), float(flat.numel())], dtype=torch.float64)
        peak = torch.tensor([flat.max().item() if flat.numel() else 0.0], dtype=torch.float64)
        dist.all_reduce(sums)  # every rank counts its DP rank's tokens tp*pp times: still a mean
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {
            "rollout/logprob_diff_mean": float(sums[0] / max(sums[1].item(), 1.0)),
            "rollout/logprob_diff_max": float(peak.item()),
        }
