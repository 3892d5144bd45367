"""Routing replay (``actor.router_replay``): megatron's MoE routers choose the experts the rollout
engine chose for each token, and every forward measures how far the routers' own choice is from
the rollout's.

megatron-core's router asks its ``router_replay`` object for each forward's top-k (megatron's
``RouterReplay`` duck type, ``get_replay_topk``). megarl puts a :class:`ReplayedRouting` there on
each router of a model (:func:`replay_routers`), and before each micro-batch's forward hands it
that micro-batch's recorded experts in the router's token order (:func:`set_routes`): ``[tokens,
top_k]`` expert ids, ``-1`` for a token the engine did not route (padding, a sequence's last
token), which routes as usual. Its top-k always computes the router's own choice too, and
counts, over the recorded tokens, how often the router's choice and the experts used equal the
rollout's as sets (:func:`routing_counts`), and, per token of the micro-batch, whether some router
of this rank chose other experts than the rollout's for it (:class:`TokenFlags`: the mismatch
metrics split by agreed and flipped tokens, megarl.trainer.routing_flags).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.models.loading import unwrap

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class RoutingCounts:
    """Recorded tokens seen, and how many of them the router's own top-k and the experts the
    forward used put on the rollout's experts (as sets)."""

    tokens: int = 0
    router_agrees: int = 0
    used_agrees: int = 0

    def add(self, other: RoutingCounts) -> None:
        self.tokens += other.tokens
        self.router_agrees += other.router_agrees
        self.used_agrees += other.used_agrees


@dataclass
class TokenFlags:
    """A micro-batch's tokens as this rank's routers saw them, by flat position in its ``[b,
    L]`` rows: which the rollout recorded (``recorded``) and for which some router's own top-k
    differed from the rollout's experts (``flipped``), over the layers (and, under sequence
    parallelism, the share of the sequence) this rank routes."""

    # [tokens, m] in the routers' order: the flat positions each token stands for (a shared
    # prompt's token one per row of its group; -1: none, as padding)
    index: torch.Tensor
    recorded: torch.Tensor  # [b * L] bool, host
    flipped: torch.Tensor  # [b * L] bool, host

    @classmethod
    def over(cls, index: torch.Tensor, positions: int) -> TokenFlags:
        none = torch.zeros(positions, dtype=torch.bool, device="cpu")  # host, like the routes
        return cls(index.reshape(index.shape[0], -1).cpu(), none, none.clone())

    def mark(self, recorded: torch.Tensor, agrees: torch.Tensor) -> None:
        """One router's forward: ``recorded`` ([tokens] in its order) and, for those tokens,
        whether its own experts were the rollout's (``agrees``)."""
        where = self.index[recorded.cpu()]
        flipped = where[~agrees.cpu()]
        self.recorded[where[where >= 0]] = True
        self.flipped[flipped[flipped >= 0]] = True


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, whether ``a`` and ``b`` (``[tokens, k]`` expert ids) hold the same experts."""
    return (a.sort(dim=1).values == b.sort(dim=1).values).all(dim=1)


class ReplayedRouting:
    """One router's replay: see the module docstring."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None  # [tokens, k]; -1: route as usual
        self.flags: TokenFlags | None = None  # the micro-batch's per-token flags, marked here
        self.replay = True
        self.counts = RoutingCounts()
        # each forward's target, in order, for the recomputation of the same forwards during the
        # backward (activation recompute re-runs the router; backwards come in forward order)
        self.recompute_queue: deque[torch.Tensor | None] = deque()

    def set_target(self, target: torch.Tensor | None, flags: TokenFlags | None = None) -> None:
        """The next forward's recorded experts (and the flags it marks); None (at a schedule's
        end): none, queue cleared."""
        self.target = target
        self.flags = flags
        if target is None:
            self.recompute_queue.clear()

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        values, own = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        recomputing = torch._C._current_graph_task_id() != -1  # inside autograd's backward
        if recomputing:
            target_in = self.recompute_queue.popleft() if self.recompute_queue else None
        else:
            target_in = self.target
            self.recompute_queue.append(target_in)
        if target_in is None:
            return values, own
        target = target_in.to(device=own.device, dtype=own.dtype)
        if target.shape != own.shape:
            raise ValueError(
                f"routing replay: {target.shape[0]} recorded tokens x top-{target.shape[1]} for a "
                f"router that sees {own.shape[0]} tokens x top-{own.shape[1]}"
            )
        recorded = target[:, 0] >= 0
        used = torch.where(recorded.unsqueeze(1), target, own) if self.replay else own
        if bool(recorded.any()) and not recomputing:
            mine, theirs = own[recorded], target[recorded]
            agrees = same_sets(mine, theirs)
            self.counts.tokens += int(recorded.sum())
            self.counts.router_agrees += int(agrees.sum())
            self.counts.used_agrees += int(same_sets(used[recorded], theirs).sum())
            if self.flags is not None:
                self.flags.mark(recorded, agrees)
        if used is own:
            return values, own
        return scores.gather(1, used), used


def routers(model) -> list[torch.nn.Module]:
    """The MoE routers of a model (or of its chunks), in layer order."""
    from megatron.core.transformer.moe.router import Router

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in unwrap(chunk).modules() if isinstance(m, Router)]


def moe_layer_index(router: torch.nn.Module, model) -> int:
    """The 0-based global layer of ``router`` (its MoE layer's ``layer_number`` is 1-based)."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for module in unwrap(chunk).modules():
            if getattr(module, "router", None) is router:
                return int(module.layer_number) - 1
    raise ValueError("routing replay: a router outside any MoE layer of the model")


def replay_routers(model, *, replay: bool = True) -> list[ReplayedRouting]:
    """A :class:`ReplayedRouting` on each router of ``model`` (``replay``: use the rollout's
    experts; else only measure); idempotent."""
    out = []
    for router in routers(model):
        current = router.router_replay
        if not isinstance(current, ReplayedRouting):
            current = ReplayedRouting()
            router.router_replay = current
        current.replay = replay
        out.append(current)
    return out


def set_routes(model, routes: torch.Tensor | None, flags: TokenFlags | None = None) -> None:
    """Hand each router of ``model`` its slice of ``routes`` (``[tokens, layers, k]`` in the
    routers' token order, layers global) and the micro-batch's ``flags`` to mark; None: route
    as usual."""
    for router in routers(model):
        replay = router.router_replay
        if not isinstance(replay, ReplayedRouting):
            continue
        layer = None if routes is None else routes[:, moe_layer_index(router, model)]
        replay.set_target(layer, flags)


def routing_counts(model) -> RoutingCounts:
    """The counts of every replayed router of ``model`` since the last call, which resets them."""
    total = RoutingCounts()
    for router in routers(model):
        replay = router.router_replay
        if isinstance(replay, ReplayedRouting):
            total.add(replay.counts)
            replay.counts = RoutingCounts()
    return total


def router_token_order(
    routes: torch.Tensor, *, sequence_parallel_rank: int | None, sequence_parallel_size: int
) -> torch.Tensor:
    """``routes`` of a micro-batch as its routers see the tokens: ``[b, s, L, k]`` (after the
    same padding as the model input) to ``[s * b, L, k]`` sequence-major, or this rank's
    contiguous share of the sequence under sequence parallelism."""
    seq_major = routes.transpose(0, 1)  # [s, b, L, k]
    if sequence_parallel_rank is not None:
        share = seq_major.shape[0] // sequence_parallel_size
        seq_major = seq_major[sequence_parallel_rank * share : (sequence_parallel_rank + 1) * share]
    return seq_major.reshape(-1, *routes.shape[2:])
