"""The tensor map of a mixture-of-experts decoder: the dense decoder's attention and norms, and in
place of its MLP a router plus routed experts (megatron's ``MoELayer`` with sequential experts).

Qwen3-MoE and Mixtral share it; they differ in HF names (:class:`MoEHFNames`), q/k norm and the
router's normalisation (in the dims). An expert's weights are per expert: megatron names them by
the index among this expert-parallel rank's experts, HF by the global index (see
:class:`megarl.models.families.base.TensorMap`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.models.families.base import Dims, TensorMap
from megarl.models.families.dense import HF_DEFAULT, HFNames, dense_tensor_maps

DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
MEGATRON_ROUTER = "mlp.router.weight"
MEGATRON_EXPERT = "mlp.experts.local_experts.{expert}."


@dataclass(frozen=True)
class MoEHFNames:
    """HF names of a layer's router and experts, within ``model.layers.{layer}.``;
    ``{expert}`` is the global expert index."""

    router: str = "mlp.gate.weight"
    expert: str = "mlp.experts.{expert}."
    gate: str = "gate_proj.weight"
    up: str = "up_proj.weight"
    down: str = "down_proj.weight"


MOE_HF_DEFAULT = MoEHFNames()


def moe_tensor_maps(
    dims: Dims,
    role: str = "actor",
    names: HFNames = HF_DEFAULT,
    moe_names: MoEHFNames = MOE_HF_DEFAULT,
) -> list[TensorMap]:
    """Every parameter of an MoE decoder in HF order: the dense map with each layer's MLP
    replaced by the router ``[experts, hidden]`` (replicated) and one gate/up and one down
    projection per expert (split over expert tensor parallelism like a dense MLP's)."""
    L, M = names.layer, "decoder.layers.{layer}."
    X = L + moe_names.expert
    h, f, e = dims.hidden_size, dims.moe_ffn_hidden_size, dims.num_experts
    moe = [
        TensorMap(M + MEGATRON_ROUTER, (L + moe_names.router,), "copy", None, (e, h)),
        TensorMap(
            M + MEGATRON_EXPERT + "linear_fc1.weight",
            (X + moe_names.gate, X + moe_names.up),
            "gate_up",
            0,
            (2 * f, h),
        ),
        TensorMap(
            M + MEGATRON_EXPERT + "linear_fc2.weight", (X + moe_names.down,), "copy", 1, (h, f)
        ),
    ]
    out: list[TensorMap] = []
    for tm in dense_tensor_maps(dims, role, names):
        if tm.megatron == M + DENSE_MLP[0]:
            out += moe
        elif tm.megatron != M + DENSE_MLP[1]:
            out.append(tm)
    return out
