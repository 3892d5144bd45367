"""The 3D layout (TP x PP x DP) of a run, its validation against a model, and its process groups.

This module is the one door to megatron's ``parallel_state`` (the one global megarl uses): it
creates and destroys the groups, and every other module asks it for this process's ranks, sizes
and groups (:func:`tp_group`, :func:`dp_rank`, :func:`is_last_stage`, ...) instead of importing
``parallel_state`` itself (a unit test holds every other module to that). The layout's rank-group
math (:class:`ParallelLayout`) is pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megarl.errors import LayoutError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _common_divisors(*values: int) -> list[int]:
    return [d for d in _divisors(min(values)) if all(v % d == 0 for v in values)]


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a model that decide which layouts can hold it."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int
    ffn_hidden_size: int
    num_experts: int = 0  # routed experts per MoE layer (0: dense)


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor (tp), pipeline (pp) and data (dp) parallel sizes; world size = tp * pp * dp.

    ``ep`` (expert parallel, mixture-of-experts models) splits each MoE layer's experts over
    ``ep`` ranks taken from the data-parallel ones (megatron's layout: expert tensor parallel =
    ``tp``, expert data parallel = ``dp / ep``), so it must divide ``dp``.

    ``pp_layers`` optionally gives an uneven split of the layers over pipeline stages
    (e.g. ``(6, 7, 7, 6)``); all middle stages must hold the same count, which is what
    megatron-core supports. ``infer_tp`` is the tensor-parallel size of the rollout engine
    (None: same as ``tp``).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    pp_layers: tuple[int, ...] | None = None
    infer_tp: int | None = None
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.infer_tp is not None and (not isinstance(self.infer_tp, int) or self.infer_tp < 1):
            raise LayoutError(
                f"parallel.infer_tp must be a positive integer, got {self.infer_tp!r}"
            )
        if self.pp_layers is not None:
            object.__setattr__(self, "pp_layers", tuple(int(x) for x in self.pp_layers))
        if self.dp % self.ep:
            raise LayoutError(
                f"parallel.ep={self.ep} must divide the data-parallel size dp={self.dp} (expert "
                f"parallel ranks are taken from the data-parallel ones); valid ep: "
                f"{_divisors(self.dp)}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def rollout_tp(self) -> int:
        return self.infer_tp if self.infer_tp is not None else self.tp

    def __str__(self) -> str:
        return f"TP{self.tp}xPP{self.pp}xDP{self.dp}" + (f"xEP{self.ep}" if self.ep > 1 else "")

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, **kw) -> ParallelLayout:
        """The layout with the given TP and PP that fills ``world_size`` ranks with DP."""
        if world_size % (tp * pp):
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
                f"choose tp*pp among the divisors of {world_size}: {_divisors(world_size)}"
            )
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), **kw)

    @classmethod
    def for_settings(cls, world_size: int, parallel, with_rollout: bool = True) -> ParallelLayout:
        """The layout a run's ``parallel`` settings (config section ``parallel``: tp, pp,
        pp_layers, infer_tp, ep) take over ``world_size`` ranks; ``with_rollout`` False drops the
        rollout's TP (a run that does not roll out)."""
        p = parallel
        return cls.for_world(
            world_size,
            tp=p.tp,
            pp=p.pp,
            pp_layers=tuple(p.pp_layers) if p.pp_layers else None,
            infer_tp=p.infer_tp if with_rollout else None,
            ep=p.ep,
        )

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise LayoutError(
                f"the layout {self} needs tp*pp*dp = {self.world_size} processes but the job has "
                f"{world_size}; launch {self.world_size} processes or set parallel.dp = "
                f"{world_size // (self.tp * self.pp) if world_size % (self.tp * self.pp) == 0 else '?'} "
                f"(world size must be a multiple of tp*pp = {self.tp * self.pp})"
            )

    def layers_per_stage(self, num_layers: int) -> list[int]:
        """Number of transformer layers held by each pipeline stage, in stage order."""
        if self.pp_layers is not None:
            return list(self.pp_layers)
        return [num_layers // self.pp] * self.pp

    def check_model(self, shape: ModelShape) -> None:
        """Raise :class:`LayoutError` naming the numbers and the valid choices if the model can't fit."""
        heads, kv = shape.num_attention_heads, shape.num_kv_heads
        tp_ok = _common_divisors(heads, kv, shape.vocab_size, shape.ffn_hidden_size)
        if self.tp not in tp_ok:
            raise LayoutError(
                f"tp={self.tp} does not divide the model: attention heads {heads}, KV heads {kv}, "
                f"vocab {shape.vocab_size}, FFN size {shape.ffn_hidden_size} must all be divisible "
                f"by tp. Valid tp for this model: {tp_ok}"
            )
        if self.infer_tp is not None and self.infer_tp not in tp_ok:
            raise LayoutError(
                f"infer_tp={self.infer_tp} does not divide the model's attention heads {heads} and "
                f"KV heads {kv}. Valid infer_tp for this model: {tp_ok}"
            )
        self._check_pipeline(shape.num_layers)
        self._check_experts(shape)
        self.check_rollout()

    def _check_experts(self, shape: ModelShape) -> None:
        if self.ep > 1 and not shape.num_experts:
            raise LayoutError(
                f"parallel.ep={self.ep} needs a mixture-of-experts model; this model is dense: "
                "set parallel.ep=1"
            )
        if shape.num_experts and shape.num_experts % self.ep:
            raise LayoutError(
                f"parallel.ep={self.ep} does not divide the model's {shape.num_experts} experts; "
                f"valid ep: {[d for d in _divisors(shape.num_experts) if self.dp % d == 0]} "
                f"(ep must also divide dp={self.dp})"
            )

    def experts_per_rank(self, num_experts: int) -> int:
        """Experts of each MoE layer held by one expert-parallel rank."""
        return num_experts // self.ep

    def _check_pipeline(self, num_layers: int) -> None:
        if self.pp > num_layers:
            raise LayoutError(
                f"pp={self.pp} is larger than the model's {num_layers} layers; "
                f"valid pp: {_divisors(num_layers)} (or an explicit parallel.pp_layers split)"
            )
        if self.pp_layers is None:
            if num_layers % self.pp:
                raise LayoutError(
                    f"pp={self.pp} does not divide the model's {num_layers} layers; choose pp among "
                    f"{_divisors(num_layers)} or give an uneven split with parallel.pp_layers "
                    f"(e.g. {_example_split(num_layers, self.pp)})"
                )
            return
        split = self.pp_layers
        if len(split) != self.pp or sum(split) != num_layers or min(split) < 1:
            raise LayoutError(
                f"parallel.pp_layers={list(split)} must have pp={self.pp} positive entries summing to "
                f"the model's {num_layers} layers, e.g. {_example_split(num_layers, self.pp)}"
            )
        if self.pp > 2 and len(set(split[1:-1])) != 1:
            raise LayoutError(
                f"parallel.pp_layers={list(split)}: the middle stages must hold equal layer counts "
                f"(only the first and last stage may differ), e.g. {_example_split(num_layers, self.pp)}"
            )

    def megatron_stage_kwargs(self, num_layers: int) -> dict[str, int | None]:
        """TransformerConfig arguments for an uneven split (empty for an even one)."""
        if self.pp_layers is None or self.pp == 1:
            return {}
        return {
            "num_layers_in_first_pipeline_stage": self.pp_layers[0],
            "num_layers_in_last_pipeline_stage": self.pp_layers[-1],
        }

    # Pure rank math (megatron's default order "tp-cp-ep-dp-pp": tp fastest, pp slowest).
    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def tp_group_ranks(self) -> list[list[int]]:
        return [
            [self.rank_of(t, d, p) for t in range(self.tp)]
            for p in range(self.pp)
            for d in range(self.dp)
        ]

    def pp_group_ranks(self) -> list[list[int]]:
        return [
            [self.rank_of(t, d, p) for p in range(self.pp)]
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def dp_group_ranks(self) -> list[list[int]]:
        return [
            [self.rank_of(t, d, p) for d in range(self.dp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    # Inference (rollout) layout: vLLM tensor parallel ``rollout_tp`` over consecutive ranks, PP 1,
    # and the world split into ``world_size / rollout_tp`` independent engines (rollout DP).
    def check_rollout(self) -> None:
        """Raise :class:`LayoutError` unless ``rollout_tp`` divides the world size."""
        itp, world = self.rollout_tp, self.world_size
        if world % itp:
            raise LayoutError(
                f"infer_tp={itp} does not divide the world size {world} ({self}); the rollout engine "
                f"splits the world into world/infer_tp engines. Valid infer_tp: {_divisors(world)}"
            )

    @property
    def rollout_dp(self) -> int:
        """Number of independent rollout engines (each one TP group of ``rollout_tp`` ranks)."""
        self.check_rollout()
        return self.world_size // self.rollout_tp

    def rollout_coords(self, rank: int) -> tuple[int, int]:
        """(rollout tp rank, rollout dp rank) of a global rank: engines own consecutive ranks."""
        self.check_rollout()
        return rank % self.rollout_tp, rank // self.rollout_tp

    def rollout_group_ranks(self) -> list[list[int]]:
        """The ranks of each rollout engine (vLLM's TP groups), in rollout DP order."""
        itp = self.rollout_tp
        return [list(range(g * itp, (g + 1) * itp)) for g in range(self.rollout_dp)]

    def infer_shard_sources(self, infer_tp_rank: int) -> list[tuple[int, int, int]]:
        """Training TP shards overlapping inference TP shard ``infer_tp_rank`` of a split dimension.

        Returns ``(train_tp_rank, start, stop)`` with ``[start, stop)`` in units of
        ``1 / lcm(tp, rollout_tp)`` of the dimension, so both layouts cut it at whole units.
        """
        tp, itp = self.tp, self.rollout_tp
        unit = tp * itp // math.gcd(tp, itp)
        lo, hi = infer_tp_rank * unit // itp, (infer_tp_rank + 1) * unit // itp
        out = []
        for t in range(tp):
            a, b = t * unit // tp, (t + 1) * unit // tp
            if max(a, lo) < min(b, hi):
                out.append((t, max(a, lo), min(b, hi)))
        return out

    def micro_dp_group_ranks(self) -> list[list[int]]:
        """HybridFlow's micro-DP groups: per (pp stage, dp replica, inference shard), the training
        ranks whose TP shards together make up that inference shard (one rank when the inference
        shard is a part of one training shard, i.e. ``rollout_tp > tp``)."""
        self.check_rollout()
        groups = []
        for p in range(self.pp):
            for d in range(self.dp):
                for i in range(self.rollout_tp):
                    ranks = [self.rank_of(t, d, p) for t, _, _ in self.infer_shard_sources(i)]
                    if ranks not in groups:
                        groups.append(ranks)
        return groups


def _example_split(num_layers: int, pp: int) -> list[int]:
    if pp <= 1:
        return [num_layers]
    if pp == 2:
        return [num_layers // 2, num_layers - num_layers // 2]
    middle = num_layers // pp
    rest = num_layers - middle * (pp - 2)
    return [rest // 2, *([middle] * (pp - 2)), rest - rest // 2]


# megatron's own timeout for the groups it creates, unless the caller derives one
MEGATRON_GROUP_TIMEOUT_S = 30 * 60.0


def initialize_model_parallel(
    layout: ParallelLayout, seed: int = 1234, timeout_s: float | None = None
) -> None:
    """Create megatron's TP/PP/DP groups over the already initialised default process group.

    ``timeout_s``: how long a collective on those groups may wait for the other ranks (a run
    derives it from ``trainer.hang_timeout_s``, as the default group's); None: megatron's 30
    minutes. megatron takes minutes and keeps fractions (its ``timedelta(minutes=...)``)."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    parallel_state = _ps()
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before the model-parallel groups")
    layout.check_world_size(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        distributed_timeout_minutes=(timeout_s or MEGATRON_GROUP_TIMEOUT_S) / 60.0,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    _ps().destroy_model_parallel()


def model_parallel_is_initialized() -> bool:
    return _ps().model_parallel_is_initialized()


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def tp_rank() -> int:
    """This process's tensor-parallel rank."""
    return _ps().get_tensor_model_parallel_rank()


def tp_size() -> int:
    return _ps().get_tensor_model_parallel_world_size()


def tp_group() -> ProcessGroup:
    return _ps().get_tensor_model_parallel_group()


def tp_group_if_split() -> ProcessGroup | None:
    """The tensor-parallel group, or None when TP is 1 (nothing to reduce over)."""
    return tp_group() if tp_size() > 1 else None


def mp_group_if_split() -> ProcessGroup | None:
    """The model-parallel group (TP x PP: the ranks that hold the same samples), or None when it
    is one rank or megatron's groups are not set up (one process)."""
    if not model_parallel_is_initialized() or tp_size() * pp_size() == 1:
        return None
    return _ps().get_model_parallel_group()


def pp_rank() -> int:
    """This process's pipeline stage."""
    return _ps().get_pipeline_model_parallel_rank()


def pp_size() -> int:
    return _ps().get_pipeline_model_parallel_world_size()


def pp_group() -> ProcessGroup:
    return _ps().get_pipeline_model_parallel_group()


def pp_last_rank() -> int:
    """Global rank of the last pipeline stage of this process's pipeline."""
    return _ps().get_pipeline_model_parallel_last_rank()


def is_first_stage() -> bool:
    return _ps().is_pipeline_first_stage()


def is_last_stage() -> bool:
    return _ps().is_pipeline_last_stage()


def dp_rank() -> int:
    """This process's data-parallel rank."""
    return _ps().get_data_parallel_rank()


def dp_size() -> int:
    return _ps().get_data_parallel_world_size()


def dp_group() -> ProcessGroup:
    return _ps().get_data_parallel_group()


def ep_rank() -> int:
    """This process's expert-parallel rank (which slice of each MoE layer's experts it holds)."""
    return _ps().get_expert_model_parallel_rank()


def ep_size() -> int:
    return _ps().get_expert_model_parallel_world_size()


def ep_group() -> ProcessGroup:
    return _ps().get_expert_model_parallel_group()


def etp_rank() -> int:
    """This process's rank in the expert tensor-parallel group (experts' weights split like TP)."""
    return _ps().get_expert_tensor_parallel_rank()


def etp_size() -> int:
    return _ps().get_expert_tensor_parallel_world_size()


def etp_group() -> ProcessGroup:
    return _ps().get_expert_tensor_parallel_group()


def current_ranks() -> dict[str, int]:
    """This process's (tp, pp, dp) ranks and sizes."""
    return {
        "tp_rank": tp_rank(),
        "tp_size": tp_size(),
        "pp_rank": pp_rank(),
        "pp_size": pp_size(),
        "dp_rank": dp_rank(),
        "dp_size": dp_size(),
    }
