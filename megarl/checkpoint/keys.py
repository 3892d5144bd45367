"""Where a megatron parameter lives in a dist checkpoint.

megatron-core saves the local layer spec under Transformer Engine's names (its
``sharded_state_dict_keys_map``: ``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``
...), so checkpoints move between the local and the TE spec. Per-layer parameters are stacked
under ``decoder.layers.<param>`` with the global layer index as dimension 0. The map is read from
megatron's own local spec, not restated here.
"""

from __future__ import annotations

import functools

LAYER_TEMPLATE = "decoder.layers.{layer}."
STACKED_PREFIX = "decoder.layers."


@functools.cache
def _keys_map() -> tuple[tuple[str, str], ...]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return tuple((spec.submodules.sharded_state_dict_keys_map or {}).items())


def dist_checkpoint_key(megatron_template: str) -> str:
    """The dist-checkpoint key of a name-map template (``TensorMap.megatron``).

    ``decoder.layers.{layer}.input_layernorm.weight`` ->
    ``decoder.layers.self_attention.linear_qkv.layer_norm_weight`` (stacked over layers);
    names outside the layers are their own key.
    """
    if not megatron_template.startswith(LAYER_TEMPLATE):
        return megatron_template
    rest = megatron_template[len(LAYER_TEMPLATE) :]
    for old, new in _keys_map():
        if rest.startswith(old):
            rest = new + rest[len(old) :]
            break
    return STACKED_PREFIX + rest
