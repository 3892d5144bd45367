"""LoRA adapters on megatron's tensor-parallel linear layers, split the way their weights are.

An adapted linear ``y = W x`` computes ``y = W x + scale * B (A dropout(x))`` with ``scale = alpha /
rank``, as peft's LoRA does, one (A, B) pair per Hugging Face projection (q/k/v, o, gate/up,
down), so the adapters are those of a peft model on the same base. megatron fuses q/k/v (per
query group) and gate/up into one linear; the pairs of the parts stay separate and their outputs
are laid out as megatron lays out the fused weight's rows.

Tensor parallelism (each part's matrices split as its base weight is):

- column-parallel (``linear_qkv``, ``linear_fc1``; weight rows split): A is whole on every TP
  rank, B's rows are split. ``A x`` is computed on the rank's input and enters the TP region
  like the base input does: copied (its gradient all-reduced) or, under sequence parallelism,
  gathered along the sequence (gradient reduce-scattered).
- row-parallel (``linear_proj``, ``linear_fc2``; weight columns split): A's columns are split,
  B is whole. ``A x`` is a partial sum reduced over TP like the base output (all-reduce, or
  reduce-scatter along the sequence under sequence parallelism).

Parameters replicated over TP but fed sequence-split activations (A of a column layer, B of a row
layer, under sequence parallelism) are tagged ``sequence_parallel`` so megatron all-reduces their
gradients over TP, as it does for norm weights. The adapters are children (``lora``) of the
linear they adapt: their names end in ``.lora.A.<part>`` / ``.lora.B.<part>``, they travel in
megatron's distributed checkpoint (sharded along the same dimension as their TP split) and are
the only trainable parameters of an adapted model.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from megarl import parallel
from megarl.errors import ConfigError
from megarl.lora_settings import ALL_LINEAR, MEGATRON_MODULES, resolve_targets
from megarl.models.dims import ModelDims, layer_offset
from megarl.models.loading import unwrap

LORA_MARK = ".lora."


@dataclass(frozen=True)
class LoraSettings:
    """What :func:`add_lora` needs (``actor.lora`` of the run config)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class PartShape:
    """One HF projection inside a megatron linear: its name and full (unsplit) weight shape."""

    name: str
    out_features: int
    in_features: int


def module_parts(dims: ModelDims, module: str) -> list[PartShape]:
    """The HF projections of a megatron linear module, with their full shapes."""
    h, hd, ffn = dims.hidden_size, dims.head_dim, dims.ffn_hidden_size
    q, kv = dims.num_attention_heads * hd, dims.num_kv_heads * hd
    shapes = {
        "linear_qkv": [(q, h), (kv, h), (kv, h)],
        "linear_proj": [(h, q)],
        "linear_fc1": [(ffn, h), (ffn, h)],
        "linear_fc2": [(h, ffn)],
    }[module]
    return [
        PartShape(name, o, i) for name, (o, i) in zip(MEGATRON_MODULES[module], shapes, strict=True)
    ]


def _row_groups(dims: ModelDims, module: str, tp: int) -> int:
    """How many row groups interleave the parts of a fused weight (q/k/v per query group)."""
    return dims.num_kv_heads // tp if module == "linear_qkv" else 1


def interleave_parts(parts: Sequence[torch.Tensor], groups: int, dim: int) -> torch.Tensor:
    """Lay the parts' rows (along ``dim``) out as megatron lays out the fused weight: for each of
    ``groups`` row groups, the group's slice of every part in order (``[q_g; k_g; v_g]`` ...)."""
    if groups == 1:
        return torch.cat(list(parts), dim=dim)
    dim = dim % parts[0].dim()
    split = [p.unflatten(dim, (groups, -1)) for p in parts]
    return torch.cat(split, dim=dim + 1).flatten(dim, dim + 1)


class LoraAdapter(nn.Module):
    """The (A, B) pairs of one megatron linear, this TP rank's shards, and the adapter forward."""

    def __init__(
        self,
        module_kind: str,
        parallel_mode: str,  # "column" | "row"
        parts: Sequence[PartShape],
        targeted: frozenset[str],
        settings: LoraSettings,
        dims: ModelDims,
        global_name: str,
        sequence_parallel: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        tp, tp_rank = parallel.tp_size(), parallel.tp_rank()
        self.parallel_mode = parallel_mode
        self.rank = settings.rank
        self.scale = settings.scale
        self.dropout = settings.dropout
        self.sequence_parallel = sequence_parallel and tp > 1
        self.enabled = True
        self.groups = _row_groups(dims, module_kind, tp)
        self.part_names = [p.name for p in parts]
        self.targeted = [p.name for p in parts if p.name in targeted]
        self.local_rows = {
            p.name: p.out_features // tp if parallel_mode == "column" else p.out_features
            for p in parts
        }
        self.A = nn.ParameterDict()
        self.B = nn.ParameterDict()
        r = settings.rank
        for p in parts:
            if p.name not in targeted:
                continue
            gen = torch.Generator().manual_seed(
                settings.seed * 1_000_003 + zlib.crc32(f"{global_name}.{p.name}".encode())
            )
            # peft's default: A like nn.Linear's init (kaiming-uniform, a=sqrt(5): U(+-1/sqrt(in)))
            # on the whole matrix (the same at any TP size), B zero: the adapted model starts equal
            # to its base.
            bound = 1.0 / math.sqrt(p.in_features)
            # drawn on the host with a CPU generator: the same numbers on any device
            a_full = torch.empty(r, p.in_features, device="cpu")
            a_full.uniform_(-bound, bound, generator=gen)
            if parallel_mode == "row":
                step = p.in_features // tp
                a_full = a_full[:, tp_rank * step : (tp_rank + 1) * step]
            A = nn.Parameter(a_full.to(device=device, dtype=dtype).contiguous())
            B = nn.Parameter(torch.zeros(self.local_rows[p.name], r, device=device, dtype=dtype))
            if parallel_mode == "column":
                set_tensor_model_parallel_attributes(B, is_parallel=True, dim=0, stride=1)
                A.sequence_parallel = self.sequence_parallel
            else:
                set_tensor_model_parallel_attributes(A, is_parallel=True, dim=1, stride=1)
                B.sequence_parallel = self.sequence_parallel
            self.A[p.name] = A
            self.B[p.name] = B

    def split_dims(self) -> dict[str, int | None]:
        """The TP-split dimension of ``A`` and ``B`` (None: whole on every TP rank)."""
        if self.parallel_mode == "column":
            return {"A": None, "B": 0}
        return {"A": 1, "B": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tpl

        group = parallel.tp_group()
        if self.dropout and self.training:
            x = nn.functional.dropout(x, p=self.dropout)
        h = torch.cat([nn.functional.linear(x, self.A[p]) for p in self.targeted], dim=-1)
        if self.parallel_mode == "column":
            if self.sequence_parallel:
                h = tpl.gather_from_sequence_parallel_region(
                    h, tensor_parallel_output_grad=True, group=group
                )
            else:
                h = tpl.copy_to_tensor_model_parallel_region(h, group=group)
        elif self.sequence_parallel:
            h = tpl.reduce_scatter_to_sequence_parallel_region(h, group=group)
        else:
            h = tpl.reduce_from_tensor_model_parallel_region(h, group=group)
        pieces = dict(zip(self.targeted, h.split(self.rank, dim=-1), strict=True))
        outs = []
        for name in self.part_names:
            if name in pieces:
                outs.append(nn.functional.linear(pieces[name], self.B[name]))
            else:  # a fused part without an adapter
                outs.append(h.new_zeros(*h.shape[:-1], self.local_rows[name]))
        return interleave_parts(outs, self.groups, dim=-1) * self.scale

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scale * B @ A`` in the layout of this rank's shard of the base weight."""
        rows = []
        in_local = next(iter(self.A.values())).shape[1]
        ref = next(iter(self.B.values()))
        for name in self.part_names:
            if name in self.A:
                rows.append(self.B[name] @ self.A[name])
            else:
                rows.append(ref.new_zeros(self.local_rows[name], in_local))
        return interleave_parts(rows, self.groups, dim=0) * self.scale


def _adapter_hook(module, args, kwargs, output):
    adapter: LoraAdapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(x).to(out.dtype), bias


def _lora_sharded_state_dict(original, adapter: LoraAdapter):
    """The linear's own sharded state, with the adapters' tensors sharded along their TP split
    (megatron's linear would save any child tensor as replicated)."""

    def sharded_state_dict(prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = original(prefix, sharded_offsets, metadata)
        own = adapter.state_dict(prefix="", keep_vars=True)
        axes = {
            k: d
            for k in own
            if (d := adapter.split_dims()[k.split(".", 1)[0]]) is not None  # "A.q_proj" -> "A"
        }
        lora_prefix = f"{prefix}lora."
        for k in own:
            out.pop(lora_prefix + k, None)
        out.update(
            make_sharded_tensors_for_checkpoint(
                own,
                lora_prefix,
                axes,
                sharded_offsets,
                tp_group=parallel.tp_group(),
                dp_cp_group=(metadata or {}).get("dp_cp_group") or parallel.dp_group(),
            )
        )
        return out

    return sharded_state_dict


def _parallel_mode(module: nn.Module) -> str:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if type(module) is ColumnParallelLinear:
        return "column"
    if type(module) is RowParallelLinear:
        return "row"
    raise ConfigError(
        f"LoRA adapts megatron's ColumnParallelLinear / RowParallelLinear (the local layer spec); "
        f"this model has {type(module).__name__}. Set model.transformer_impl=local"
    )


def add_lora(model: nn.Module, dims: ModelDims, layer_offset: int, settings: LoraSettings) -> int:
    """Freeze ``model`` and attach adapters to its targeted linears; returns how many were added.

    ``layer_offset``: global index of the stage's first layer (adapters are initialised from the
    global name, so every layout starts from the same adapters)."""

    gpt = unwrap(model)
    targeted = resolve_targets(settings.target_modules)
    sequence_parallel = bool(getattr(gpt.config, "sequence_parallel", False))
    gpt.requires_grad_(False)
    added = 0
    for name, module in list(gpt.named_modules()):
        kind = name.rsplit(".", 1)[-1]
        if kind not in MEGATRON_MODULES or not name.startswith("decoder.layers."):
            continue
        parts = module_parts(dims, kind)
        if not any(p.name in targeted for p in parts):
            continue
        weight = module.weight
        adapter = LoraAdapter(
            kind,
            _parallel_mode(module),
            parts,
            targeted,
            settings,
            dims,
            global_layer_name(name, layer_offset),
            sequence_parallel,
            weight.dtype,
            weight.device,
        )
        module.add_module("lora", adapter)
        module.register_forward_hook(_adapter_hook, with_kwargs=True)
        module.sharded_state_dict = _lora_sharded_state_dict(module.sharded_state_dict, adapter)
        added += 1
    return added


def global_layer_name(name: str, offset: int) -> str:
    """A stage-local ``decoder.layers.<i>...`` name with the global layer index."""
    head, _, rest = name.partition("decoder.layers.")
    layer, _, tail = rest.partition(".")
    return f"{head}decoder.layers.{int(layer) + offset}.{tail}"


def adapters(model: nn.Module) -> Iterator[tuple[str, LoraAdapter]]:
    """(linear module name, adapter) of every adapted linear of ``model``."""

    for name, module in unwrap(model).named_modules():
        if isinstance(module, LoraAdapter):
            yield name.removesuffix(".lora"), module


def has_lora(model: nn.Module) -> bool:
    return next(adapters(model), None) is not None


def is_lora_parameter(name: str) -> bool:
    return LORA_MARK in f".{name}"


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model: every adapter is skipped inside the block (the reference policy of a LoRA
    actor)."""
    found = [a for _, a in adapters(model)]
    before = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield model
    finally:
        for a, was in zip(found, before, strict=True):
            a.enabled = was


def add_lora_for_layout(model: nn.Module, dims: ModelDims, layout, settings: LoraSettings) -> int:
    """:func:`add_lora` on this rank's pipeline stage of ``layout``."""

    return add_lora(model, dims, layer_offset(dims, layout, parallel.pp_rank()), settings)


def lora_record(model: nn.Module) -> dict[str, object] | None:
    """The adapters' settings as a checkpoint records them (None without adapters)."""
    found = [a for _, a in adapters(model)]
    if not found:
        return None
    first = found[0]
    return {
        "rank": first.rank,
        "alpha": first.scale * first.rank,
        "dropout": first.dropout,
        "target_modules": sorted({t for a in found for t in a.targeted}),
    }
