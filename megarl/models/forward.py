"""Forward (and backward) passes through megatron's pipeline schedule, micro-batch by micro-batch.

Sequences are packed to the right (prompt then response, padding at the end), so a plain causal
mask is exact for every real token and no attention mask tensor is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from megarl import parallel

MicroBatch = TypeVar("MicroBatch")
# loss_fn(output, micro_batch) -> (loss, metrics). ``output`` is the last stage's model output
# (vocab-parallel logits [b, s, v/tp] for the actor, values [b, s, 1] for the critic);
# ``micro_batch`` is what the caller splits its batch into (``LossOver[Samples]`` for the PPO
# trainer's losses, which run_schedule's callers wrap).
LossOver = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, Any]]]
LossFn = LossOver[dict[str, Any]]  # the loss run_schedule takes: one micro-batch's dict


def position_ids_like(input_ids: torch.Tensor) -> torch.Tensor:
    return (
        torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    )


def _select_hook(module, args, kwargs):
    """Forward pre-hook of the output layer: gather the sequence-parallel hidden states (if the
    model splits them along the sequence), then keep only those at the chosen positions."""
    hidden = args[0]  # [s, b, h]; [s / tp, b, h] under sequence parallelism
    if getattr(module, "_megarl_gather_sequence", False):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        # Backward only splits: the TP reduction of the input gradient is the output layer's own
        # (ColumnParallelLinear, now run without sequence parallelism, all-reduces it), and a
        # replicated scalar head gives every TP rank the whole gradient already.
        hidden = gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=False, group=parallel.tp_group()
        )
    index = getattr(module, "_megarl_positions", None)
    if index is not None and hidden.shape[1] == 1 and index.shape[0] != 1:
        # A pack ([T, 1, h], see megarl.models.packing): ``index`` holds [b, P] pack positions.
        hidden = hidden[:, 0][index.to(hidden.device)].transpose(0, 1)  # [P, b, h]
    elif index is not None:
        rows = index.t().to(hidden.device)  # [P, b]
        hidden = hidden.gather(0, rows.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    if getattr(module, "_megarl_batch_major", True):
        # Batch-major rows: the projection's output is then [b, s, v] in memory, which GPTModel's
        # closing ``transpose(0, 1).contiguous()`` returns without a copy (_sequence_major_view).
        hidden = hidden.transpose(0, 1).contiguous()
    return (hidden, *args[1:]), kwargs


def _sequence_major_view(module, args, kwargs, output):
    """Forward hook of the output layer, after :func:`_select_hook` made its rows batch-major:
    hand GPTModel the ``[s, b, v]`` view it expects of the ``[b, s, v]`` projection.

    GPTModel returns ``logits.transpose(0, 1).contiguous()``; from a sequence-major projection that
    is a copy of the whole logits tensor, and its backward two more (the transposed gradient made
    contiguous for the weight and input gradients). Transposing the hidden states instead copies
    ``hidden / vocab`` as much (576 vs 49,152 values per token on SmolLM2).
    """
    if not getattr(module, "_megarl_batch_major", True):
        return output
    out, bias = output
    return out.transpose(0, 1), bias


def use_batch_major_output(model, on: bool = True) -> None:
    """Whether the model's output layer projects batch-major rows (the default; ``False``:
    megatron's sequence-major layout and its logits copies, for comparisons)."""
    from megarl.models.loading import unwrap

    layer = getattr(unwrap(model), "output_layer", None)
    if layer is not None:
        layer._megarl_batch_major = on


def _sequence_parallel(model) -> bool:
    from megarl.models.loading import unwrap

    config = getattr(unwrap(model), "config", None)
    return bool(getattr(config, "sequence_parallel", False)) and parallel.tp_size() > 1


def _install_select_hook(layer, sequence_parallel: bool) -> None:
    """Under sequence parallelism megatron's output layer all-gathers the sequence itself, after
    any pre-hook: the hook takes that gather over (positions are chosen on the whole sequence)
    and the layer runs as a plain column-parallel linear."""
    layer.register_forward_pre_hook(_select_hook, with_kwargs=True)
    layer.register_forward_hook(_sequence_major_view, with_kwargs=True)
    layer._megarl_select_hook = True
    layer._megarl_gather_sequence = sequence_parallel
    if sequence_parallel and hasattr(layer, "sequence_parallel"):
        layer.sequence_parallel = False


def select_output_positions(model, positions: torch.Tensor | None) -> None:
    """Make the model's output layer (LM head or scalar head) project only ``positions``
    (``[b, P]`` sequence positions per row) in its next forward, so the output is ``[b, P, ...]``.

    RL losses need the outputs at response positions only; projecting every prompt position onto a
    150k vocabulary dominates a step's time and memory. ``None`` restores all positions.
    """
    from megarl.models.loading import unwrap

    layer = getattr(unwrap(model), "output_layer", None)
    if layer is None:  # not the last pipeline stage
        return
    if not getattr(layer, "_megarl_select_hook", False):
        _install_select_hook(layer, _sequence_parallel(model))
    layer._megarl_positions = positions


def run_schedule(
    model,
    micro_batches: Sequence[dict[str, Any]],
    loss_fn: LossFn,
    *,
    forward_only: bool,
) -> list[dict[str, Any]]:
    """Run megatron's forward(-backward) schedule; returns loss_fn's metrics (last stage, else []).

    A micro-batch may carry ``positions`` ([b, P]): the last stage then computes its output at
    those sequence positions only (see :func:`select_output_positions`). A micro-batch carrying
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

    def forward_step(data_iterator, model_chunk):
        batch = next(data_iterator)
        ids = batch["input_ids"]
        seq = ids.shape[1]
        all_positions = batch.get("positions") is None
        if "seq_lens" in batch:
            output = _packed_forward(model_chunk, batch, multiple)
            all_positions = False  # the pack's outputs come at [b, L] positions already
        else:
            padded = pad_to_multiple(ids, multiple)
            select_output_positions(model_chunk, batch.get("positions"))
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
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=it,
        model=model,
        num_microbatches=n,
        seq_length=seq_len,
        micro_batch_size=mbs,
        forward_only=forward_only,
    )


def _tokens_in(batch: dict[str, Any]) -> int:
    """The sequence length the model sees for this micro-batch (one row when packed)."""
    if "seq_lens" in batch:
        return int(batch["seq_lens"].sum())
    return int(batch["input_ids"].shape[1])


def _packed_forward(model_chunk, batch: dict[str, Any], multiple: int) -> torch.Tensor:
    """The model's output for a micro-batch run as one pack, at ``positions`` (or at every
    position) of the padded rows."""
    from megarl.models.packing import all_positions, pack, packed_positions

    ids = batch["input_ids"]
    packed = pack(ids, batch["seq_lens"], multiple)
    positions = batch.get("positions")
    if positions is None:
        positions = all_positions(ids)
    select_output_positions(model_chunk, packed_positions(packed, positions))
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
    import torch.distributed as dist

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
