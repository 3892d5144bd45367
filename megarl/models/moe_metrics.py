"""The router losses of a mixture-of-experts model, as metrics.

megatron's router records each MoE layer's load-balancing loss and z-loss (unscaled by their
coefficients) in a layer-wise tracker during training forwards, when their coefficients
(``model.moe_aux_loss_coeff``, ``model.moe_z_loss_coeff``) are set. This reads and clears it
after an optimizer step. A dense model, or an MoE model with both losses off, records nothing.
"""

from __future__ import annotations


def router_loss_metrics(role: str, micro_batches: int, num_moe_layers: int) -> dict[str, float]:
    """``<role>/moe_<loss>``: each recorded router loss, averaged over the MoE layers (every
    layer, in the supported families) and the step's micro-batches, reduced over pipeline stages
    and data-parallel ranks as megatron reduces them (collective: every rank calls it after the
    same step); then cleared."""
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if not tracker:
        return {}
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    scale = max(1, micro_batches) * max(1, num_moe_layers)
    out = {
        f"{role}/moe_{name}": float(entry["values"].float().sum()) / scale
        for name, entry in sorted(tracker.items())
    }
    moe_utils.clear_aux_losses_tracker()
    return out
