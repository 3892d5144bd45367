"""Where a megatron parameter lives in a dist checkpoint.

megatron-core saves the local layer spec under Transformer Engine's names (the spec's
``sharded_state_dict_keys_map``), so checkpoints move between the local and the TE spec.
Per-layer parameters are stacked under ``decoder.layers.<param>`` with the global layer index as
dimension 0. The map is restated here so that reading a checkpoint needs no megatron import;
``tests/unit/test_checkpoints_format.py`` pins it to megatron's own local spec.
"""

from __future__ import annotations

LAYER_TEMPLATE = "decoder.layers.{layer}."
STACKED_PREFIX = "decoder.layers."

# megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec().submodules
#   .sharded_state_dict_keys_map (megatron-core 0.16)
LOCAL_SPEC_KEYS_MAP: dict[str, str] = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


# megatron's sequential experts save each local expert under its global index, stacked along
# dim 1 (after the layer): ``decoder.layers.mlp.experts.experts.<param>`` [layers, experts, ...]
LOCAL_EXPERT = "mlp.experts.local_experts.{expert}."
STACKED_EXPERT = "mlp.experts.experts."


def dist_checkpoint_key(megatron_template: str) -> str:
    """The dist-checkpoint key of a name-map template (``TensorMap.megatron``).

    ``decoder.layers.{layer}.input_layernorm.weight`` ->
    ``decoder.layers.self_attention.linear_qkv.layer_norm_weight`` (stacked over layers);
    names outside the layers are their own key.
    """
    if not megatron_template.startswith(LAYER_TEMPLATE):
        return megatron_template
    rest = megatron_template[len(LAYER_TEMPLATE) :]
    for old, new in {**LOCAL_SPEC_KEYS_MAP, LOCAL_EXPERT: STACKED_EXPERT}.items():
        if rest.startswith(old):
            rest = new + rest[len(old) :]
            break
    return STACKED_PREFIX + rest
