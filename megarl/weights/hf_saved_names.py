"""Where each tensor a Hugging Face checkpoint names lives in a loaded transformers model.

transformers 5 keeps some weights in another layout in memory than on disk: an MoE layer's
experts are fused (``mlp.experts.gate_up_proj`` [E, 2I, H]) while the checkpoint (and the
reshard) names them per expert (``mlp.experts.3.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.3.w1.weight``). The saved layout is what transformers' own
``revert_weight_conversion`` (the ``save_pretrained`` path) produces; running it over a probe
whose values are the positions of the parameters' elements tells, for every saved name, which
elements of which parameter it is, whatever the conversion does (split, rename, transpose).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SavedTensor:
    """A saved tensor as a set of elements of one in-memory parameter, in saved order."""

    param: torch.nn.Parameter
    positions: torch.Tensor  # flat indices into ``param``, shaped like the saved tensor

    @torch.no_grad()
    def write(self, tensor: torch.Tensor, dim: int | None = None, start: int = 0) -> None:
        """Write the saved tensor, or (``dim``) its slice starting at ``start`` along ``dim``."""
        positions = self.positions
        if dim is not None:
            positions = positions.narrow(dim, start, tensor.shape[dim])
        flat = self.param.data.view(-1)
        flat.index_copy_(0, positions.reshape(-1), tensor.reshape(-1).to(flat.dtype))


def saved_tensor_index(model: torch.nn.Module) -> dict[str, SavedTensor]:
    """Saved name -> :class:`SavedTensor` for every saved name that is not a parameter name
    (empty when the model keeps the checkpoint's layout)."""
    from transformers.core_model_loading import revert_weight_conversion

    params = dict(model.named_parameters())
    starts, names, probe, base = [], [], {}, 0
    for name, p in params.items():
        probe[name] = torch.arange(base, base + p.numel(), dtype=torch.float64).reshape(p.shape)
        starts.append(base)
        names.append(name)
        base += p.numel()
    if base >= 2**53:
        raise ValueError("model too large for the float64 position probe")
    saved = revert_weight_conversion(model, probe)
    out: dict[str, SavedTensor] = {}
    for saved_name, values in saved.items():
        if saved_name in params:
            continue
        positions = values.to(torch.int64)
        first = int(positions.reshape(-1)[0])
        owner = names[bisect.bisect_right(starts, first) - 1]
        local = positions - starts[names.index(owner)]
        if int(local.min()) < 0 or int(local.max()) >= params[owner].numel():
            raise ValueError(f"{saved_name} spans several parameters; not a supported layout")
        out[saved_name] = SavedTensor(params[owner], local.to(params[owner].device))
    return out
