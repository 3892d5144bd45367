"""Forward (and backward) passes through megatron's pipeline schedule, micro-batch by micro-batch.

Sequences are packed to the right (prompt then response, padding at the end), so a plain causal
mask is exact for every real token and no attention mask tensor is needed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megarl import parallel
from megarl.models.loading import unwrap
from megarl.models.packing import (
    PackedBatch,
    all_positions,
    pack,
    packed_positions,
    packed_values,
)
from megarl.models.router_replay import TokenFlags, router_token_order, set_routes
from megarl.models.shared_prompts import (
    SharedPromptPack,
    pack_shared_prompts,
    rotary_positions,
    shared_sources,
    shared_values,
)

MicroBatch = TypeVar("MicroBatch")
# loss_fn(output, micro_batch) -> (loss, metrics). ``output`` is the last stage's model output
# (vocab-parallel logits [b, s, v/tp] for the actor, values [b, s, 1] for the critic);
# ``micro_batch`` is what the caller splits its batch into (``LossOver[Samples]`` for the PPO
# trainer's losses, which run_schedule's callers wrap).
LossOver = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, Any]]]
LossFn = LossOver[dict[str, Any]]  # the loss run_schedule takes: one micro-batch's dict
# actor.router_replay: the key under which a replayed micro-batch's dict gets its TokenFlags
ROUTING_FLAGS = "routing_flags"


def position_ids_like(input_ids: torch.Tensor) -> torch.Tensor:
    return (
        torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    )


class _OutputHooks:
    """The output layer's two hooks and their setting, held by the hooks themselves (megarl sets no
    attribute of its own on megatron's modules): the pre-hook gathers a sequence-parallel input
    and keeps only the positions of the active :func:`output_positions` scope; the forward hook
    hands GPTModel an ``[s, b, v]`` view of a batch-major projection."""

    def __init__(self, gather_sequence: bool) -> None:
        self.gather_sequence = gather_sequence
        self.batch_major = True

    def before(self, module, args, kwargs):
        """Forward pre-hook: gather the sequence-parallel hidden states (if the model splits them
        along the sequence), then keep only those at the chosen positions."""
        hidden = args[0]  # [s, b, h]; [s / tp, b, h] under sequence parallelism
        if self.gather_sequence:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Backward only splits: the TP reduction of the input gradient is the output layer's
            # own (ColumnParallelLinear, now run without sequence parallelism, all-reduces it),
            # and a replicated scalar head gives every TP rank the whole gradient already.
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=parallel.tp_group()
            )
        scope = _POSITIONS.get()
        index = scope[1] if scope is not None and scope[0] is self else None
        if index is not None and hidden.shape[1] == 1 and index.shape[0] != 1:
            # A pack ([T, 1, h], see megarl.models.packing): ``index`` holds [b, P] pack positions.
            hidden = hidden[:, 0][index.to(hidden.device)].transpose(0, 1)  # [P, b, h]
        elif index is not None:
            rows = index.t().to(hidden.device)  # [P, b]
            hidden = hidden.gather(0, rows.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        if self.batch_major:
            # Batch-major rows: the projection's output is then [b, s, v] in memory, which
            # GPTModel's closing ``transpose(0, 1).contiguous()`` returns without a copy (after).
            hidden = hidden.transpose(0, 1).contiguous()
        return (hidden, *args[1:]), kwargs

    def after(self, module, args, kwargs, output):
        """Forward hook, after :meth:`before` made the rows batch-major: hand GPTModel the
        ``[s, b, v]`` view it expects of the ``[b, s, v]`` projection.

        GPTModel returns ``logits.transpose(0, 1).contiguous()``; from a sequence-major projection
        that is a copy of the whole logits tensor, and its backward two more (the transposed
        gradient made contiguous for the weight and input gradients). Transposing the hidden
        states instead copies ``hidden / vocab`` as much (576 vs 49,152 values per token on
        SmolLM2).
        """
        if not self.batch_major:
            return output
        out, bias = output
        return out.transpose(0, 1), bias


# The hooks installed on each output layer (weak: a freed model takes its entry with it), and the
# positions the active output_positions scope selects, with the hooks they are meant for.
_HOOKS: weakref.WeakKeyDictionary[torch.nn.Module, _OutputHooks] = weakref.WeakKeyDictionary()
_POSITIONS: ContextVar[tuple[_OutputHooks, torch.Tensor | None] | None] = ContextVar(
    "megarl_output_positions", default=None
)


def _output_hooks(model) -> _OutputHooks | None:
    """The hooks of the model's output layer (LM head or scalar head), installed on first use;
    None on a stage without one (not the last pipeline stage)."""

    layer = getattr(unwrap(model), "output_layer", None)
    if layer is None:
        return None
    hooks = _HOOKS.get(layer)
    if hooks is None:
        hooks = _install_output_hooks(layer, _sequence_parallel(model))
    return hooks


def use_batch_major_output(model, on: bool = True) -> None:
    """Whether the model's output layer projects batch-major rows (the default; ``False``:
    megatron's sequence-major layout and its logits copies, for comparisons)."""
    hooks = _output_hooks(model)
    if hooks is not None:
        hooks.batch_major = on


def _sequence_parallel(model) -> bool:

    config = getattr(unwrap(model), "config", None)
    return bool(getattr(config, "sequence_parallel", False)) and parallel.tp_size() > 1


def _install_output_hooks(layer: torch.nn.Module, sequence_parallel: bool) -> _OutputHooks:
    """Under sequence parallelism megatron's output layer all-gathers the sequence itself, after
    any pre-hook: the hook takes that gather over (positions are chosen on the whole sequence)
    and the layer runs as a plain column-parallel linear (its own ``sequence_parallel`` off)."""
    hooks = _OutputHooks(sequence_parallel)
    layer.register_forward_pre_hook(hooks.before, with_kwargs=True)
    layer.register_forward_hook(hooks.after, with_kwargs=True)
    if sequence_parallel and hasattr(layer, "sequence_parallel"):
        layer.sequence_parallel = False
    _HOOKS[layer] = hooks
    return hooks


@contextlib.contextmanager
def output_positions(model, positions: torch.Tensor | None) -> Iterator[None]:
    """Inside the block, the model's output layer (LM head or scalar head) projects only
    ``positions`` (``[b, P]`` sequence positions per row), so the output is ``[b, P, ...]``;
    ``None``: every position. The scope ends with the block, exception or not.

    RL losses need the outputs at response positions only; projecting every prompt position onto a
    150k vocabulary dominates a step's time and memory.
    """
    hooks = _output_hooks(model)
    token = _POSITIONS.set(None if hooks is None else (hooks, positions))
    try:
        yield
    finally:
        _POSITIONS.reset(token)


def run_schedule(
    model,
    micro_batches: Sequence[dict[str, Any]],
    loss_fn: LossFn,
    *,
    forward_only: bool,
) -> list[dict[str, Any]]:
    """Run megatron's forward(-backward) schedule; returns loss_fn's metrics (last stage, else []).

    A micro-batch may carry ``positions`` ([b, P]): the last stage then computes its output at
    those sequence positions only (see :func:`output_positions`). A micro-batch carrying
    ``seq_lens`` ([b] real lengths of its right-padded rows) runs packed: its rows end to end in
    one sequence, attention and rotary positions per row (:mod:`megarl.models.packing`); the
    output keeps the padded run's ``[b, P or L, ...]`` shape.

    The loss returned by ``loss_fn`` is back-propagated as is: megatron divides each micro-batch
    loss by the number of micro-batches, so it is multiplied back here and the caller decides the
    normalisation (e.g. token-mean over the whole mini-batch).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = len(micro_batches)
    it = iter(micro_batches)
    chunks = model if isinstance(model, (list, tuple)) else [model]
    multiple = parallel.tp_size() if _sequence_parallel(chunks[0]) else 1

    replayed = any(b.get("routes") is not None for b in micro_batches)

    def forward_step(data_iterator, model_chunk):
        batch = next(data_iterator)
        ids = batch["input_ids"]
        seq = ids.shape[1]
        if replayed:  # actor.router_replay: this micro-batch's recorded experts, or none
            routes = _routes_in_router_order(batch, multiple)
            flags = None
            if routes is not None:  # the caller reads them (megarl.trainer.routing_flags)
                flags = batch.setdefault(ROUTING_FLAGS, _token_flags(batch, multiple))
            set_routes(model_chunk, routes, flags)
        all_positions = batch.get("positions") is None
        if "seq_lens" in batch:
            output = _packed_forward(model_chunk, batch, multiple)
            all_positions = False  # the pack's outputs come at [b, L] positions already
        else:
            padded = pad_to_multiple(ids, multiple)
            with output_positions(model_chunk, batch.get("positions")):
                output = model_chunk(
                    input_ids=padded, position_ids=position_ids_like(padded), attention_mask=None
                )

        def loss_func(out: torch.Tensor):
            if all_positions and out.shape[1] != seq:
                out = out[:, :seq]
            loss, metrics = loss_fn(out, batch)
            return loss * n, metrics

        return output, loss_func

    seq_len = max(_tokens_in(b) for b in micro_batches)
    seq_len = -(-seq_len // multiple) * multiple
    mbs = max(1 if "seq_lens" in b else int(b["input_ids"].shape[0]) for b in micro_batches)
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=it,
            model=model,
            num_microbatches=n,
            seq_length=seq_len,
            micro_batch_size=mbs,
            forward_only=forward_only,
        )
    finally:
        if replayed:  # no later forward routes by this schedule's last micro-batch
            for chunk in chunks:
                set_routes(chunk, None)


def _token_flags(batch: dict[str, Any], multiple: int) -> TokenFlags:
    """Empty flags over a micro-batch's ``[b, L]`` positions, their index in the routers' order
    (a shared prompt's token stands for its place in every row of its group)."""
    b, width = batch["input_ids"].shape
    if "prompt_lens" in batch:
        sources = shared_sources(_shared_pack(batch, multiple), width)  # [T, m]
        index = _split_for_sequence_parallel(sources.unsqueeze(0).unsqueeze(-1), multiple)
    else:
        positions = torch.arange(b * width, device="cpu").reshape(b, width, 1, 1)  # like routes
        index = _in_router_order(positions, batch, multiple)
    return TokenFlags.over(index, b * width)


def _routes_in_router_order(batch: dict[str, Any], multiple: int) -> torch.Tensor | None:
    """A micro-batch's ``routes`` (``[b, L, layers, k]`` recorded experts, -1: none) in the
    token order its routers see: padded like ``input_ids`` (or packed like them, a shared
    prompt's from the first row of its group), sequence-major, this TP rank's share under
    sequence parallelism (``multiple`` > 1)."""
    routes = batch.get("routes")
    if routes is None:
        return None
    return _in_router_order(routes, batch, multiple)


def _shared_pack(batch: dict[str, Any], multiple: int) -> SharedPromptPack:
    return pack_shared_prompts(
        batch["input_ids"], batch["prompt_lens"], batch["seq_lens"], multiple
    )


def _in_router_order(values: torch.Tensor, batch: dict[str, Any], multiple: int) -> torch.Tensor:
    """Per-token ``[b, L, x, y]`` values of a micro-batch in its routers' token order, -1 at
    the padding the forward adds."""
    if "prompt_lens" in batch:
        ordered = shared_values(_shared_pack(batch, multiple), values, fill=-1).unsqueeze(0)
    elif "seq_lens" in batch:
        ordered = packed_values(values, batch["seq_lens"], multiple, fill=-1).unsqueeze(0)
    else:
        extra = -values.shape[1] % multiple
        ordered = torch.nn.functional.pad(values, (0, 0, 0, 0, 0, extra), value=-1)
    return _split_for_sequence_parallel(ordered, multiple)


def _split_for_sequence_parallel(ordered: torch.Tensor, multiple: int) -> torch.Tensor:
    split = multiple > 1
    return router_token_order(
        ordered,
        sequence_parallel_rank=parallel.tp_rank() if split else None,
        sequence_parallel_size=multiple,
    )


def _tokens_in(batch: dict[str, Any]) -> int:
    """The sequence length the model sees for this micro-batch (one row when packed)."""
    if "seq_lens" in batch:
        return int(batch["seq_lens"].sum())
    return int(batch["input_ids"].shape[1])


def _packed_forward(model_chunk, batch: dict[str, Any], multiple: int) -> torch.Tensor:
    """The model's output for a micro-batch run as one pack, at ``positions`` (or at every
    position) of the padded rows."""

    ids = batch["input_ids"]
    positions = batch.get("positions")
    if positions is None:
        positions = all_positions(ids)
    packed: PackedBatch | SharedPromptPack
    rotary: contextlib.AbstractContextManager[None]
    if "prompt_lens" in batch:  # one pass through each distinct prompt per micro-batch
        shared = pack_shared_prompts(ids, batch["prompt_lens"], batch["seq_lens"], multiple)
        packed, index, rotary = (
            shared,
            shared.index(positions),
            rotary_positions(model_chunk, shared),
        )
    else:
        plain = pack(ids, batch["seq_lens"], multiple)
        packed, index, rotary = plain, packed_positions(plain, positions), contextlib.nullcontext()
    with output_positions(model_chunk, index), rotary:
        return model_chunk(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=None,
            packed_seq_params=packed.seq_params(),
        )


def pad_to_multiple(input_ids: torch.Tensor, multiple: int) -> torch.Tensor:
    """``input_ids`` right-padded (token 0) to a length divisible by ``multiple``.

    Sequence parallelism splits the sequence evenly over the TP ranks. Padding at the end is
    exact under the causal mask: no real token attends to it, and its outputs are dropped.
    """
    extra = -input_ids.shape[1] % multiple
    if extra == 0:
        return input_ids
    return torch.nn.functional.pad(input_ids, (0, extra), value=0)


def broadcast_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the last pipeline stage holds it, on every stage (in place; collective)."""

    if parallel.pp_size() > 1:
        dist.broadcast(tensor, src=parallel.pp_last_rank(), group=parallel.pp_group())
    return tensor


def gather_vocab(logits_shard: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from this rank's vocab-parallel shard (for tests and export)."""
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits_shard)


@torch.no_grad()
def forward_logits(model, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, v] on the last pipeline stage; None on the other stages."""
    outputs = run_schedule(
        model,
        [{"input_ids": input_ids}],
        lambda out, batch: (out.sum() * 0.0, {"logits": gather_vocab(out)}),
        forward_only=True,
    )
    return outputs[0]["logits"] if outputs else None
