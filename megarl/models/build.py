"""Build actor, critic and reference megatron-core GPT models from a Hugging Face checkpoint.

Parallelism comes from megatron's parallel_state (set up by :mod:`megarl.parallel`); the model
definition itself is the model family (:mod:`megarl.models.families`) read through
:mod:`megarl.models.dims` and :mod:`megarl.models.hf_map`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megarl import parallel, platform
from megarl.backends import resolve_transformer_impl, this_machine
from megarl.console import announce
from megarl.errors import LayoutError
from megarl.gpu_defaults import kernel_options
from megarl.models.dims import ModelDims
from megarl.models.heads import SCALAR_HEADS, has_scalar_head
from megarl.models.hf_map import NameIndex
from megarl.models.loading import load_hf_into_model
from megarl.models.norm import SequenceParallelTorchNorm
from megarl.models.rotary import use_cached_rotary
from megarl.models.value_head import ValueHead
from megarl.parallel import ParallelLayout

ROLES = ("actor", "critic", "reference", "reward")


@dataclass(frozen=True)
class ModelOptions:
    dtype: torch.dtype = torch.float32
    recompute: str = "none"  # none | selective | full (see RECOMPUTE)
    recompute_num_layers: int = 1  # layers per checkpoint with full recompute
    transformer_impl: str = "auto"  # auto | local | transformer_engine (megarl.backends)
    # Megatron sequence parallelism (norms, dropout and residuals split along the sequence over
    # the TP group); None: on when tp > 1.
    sequence_parallel: bool | None = None
    # Dropout stays off: RL losses compare logprobs of the same tokens across passes.
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # MoE router losses (added to the gradients by megatron, reported by megarl.models.moe_metrics)
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0


def resolve_sequence_parallel(setting: bool | None, tp: int) -> bool:
    """Whether sequence parallelism is on for this TP size (``None``: on when tp > 1)."""
    if setting is None:
        return tp > 1
    if setting and tp == 1:
        raise LayoutError(
            "parallel.sequence_parallel=true needs tensor parallelism (parallel.tp > 1): "
            "set parallel.tp > 1 or parallel.sequence_parallel=false (or leave it unset)"
        )
    return bool(setting)


def transformer_config(dims: ModelDims, layout: ParallelLayout, opts: ModelOptions | None = None):
    """megatron TransformerConfig for these dims; TP/PP sizes must equal parallel_state's."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    opts = opts or ModelOptions()
    cuda = torch.cuda.is_available()
    impl = resolve_transformer_impl(opts.transformer_impl)
    kwargs = dict(
        # Family-specific: sizes, norm, gated MLP, biases, q/k norm (megarl.models.families).
        **dims.model_family.megatron_options(dims),
        # Megatron's TransformerConfig calls the TP/PP sizes by these names; they must agree with
        # parallel_state or every stage silently builds all layers (megatron-core 0.16 reads the
        # stage's layer count from the config, not from the groups).
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        layernorm_epsilon=dims.rms_norm_eps,
        activation_func=torch.nn.functional.silu,
        attention_dropout=opts.attention_dropout,
        hidden_dropout=opts.hidden_dropout,
        params_dtype=opts.dtype,
        bf16=opts.dtype == torch.bfloat16,
        fp16=opts.dtype == torch.float16,
        pipeline_dtype=opts.dtype,
        use_cpu_initialization=not cuda,
        perform_initialization=False,  # every weight is loaded from the checkpoint
        transformer_impl=impl,  # what the layer spec builds (megarl.models.distributed reads it)
        # CUDA-only fused kernels, TE's rope and weight-gradient fusions (megarl.gpu_defaults)
        **kernel_options(impl, this_machine()).transformer_config(),
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,  # megarl's vocab-parallel log-prob is the loss
        # Rollouts differ in length per micro-batch; PP stages exchange shapes first.
        variable_seq_lengths=True,
        # Dense models have no MoE dispatcher, but the config check for variable_seq_lengths
        # rejects the default ("allgather") regardless.
        moe_token_dispatcher_type="alltoall",
        sequence_parallel=resolve_sequence_parallel(opts.sequence_parallel, layout.tp),
        **layout.megatron_stage_kwargs(dims.num_layers),
    )
    kwargs.update(recompute_settings(opts.recompute, opts.recompute_num_layers))
    if dims.is_moe:
        kwargs.update(moe_loss_settings(opts))
        # As with TP/PP: megatron reads the expert layout from the config too (which parameters
        # skip the data-parallel all-reduce, how the optimizer shards them).
        kwargs.update(expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.tp)
        # grouped GEMM over the local experts with Transformer Engine's layers (the layer spec
        # builds TEGroupedMLP to match: layer_spec)
        kwargs["moe_grouped_gemm"] = kernel_options(impl, this_machine()).moe_grouped_gemm
    return TransformerConfig(**kwargs)


def moe_loss_settings(opts: ModelOptions) -> dict[str, object]:
    """megatron's router-loss settings: the load-balancing loss only when its coefficient is set
    (``none`` skips computing it), the z-loss likewise."""
    aux = opts.moe_aux_loss_coeff
    return {
        "moe_router_load_balancing_type": "aux_loss" if aux > 0 else "none",
        "moe_aux_loss_coeff": aux,
        "moe_z_loss_coeff": opts.moe_z_loss_coeff or None,
    }


def _no_recompute(num_layers: int) -> dict[str, object]:
    return {}


def _selective_recompute(num_layers: int) -> dict[str, object]:
    # megatron's default selective module list is the core attention (scores and softmax).
    return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}


def _full_recompute(num_layers: int) -> dict[str, object]:
    return {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": num_layers,
    }


# model.recompute kind -> TransformerConfig settings (layers per checkpoint for "full").
RECOMPUTE = {"none": _no_recompute, "selective": _selective_recompute, "full": _full_recompute}


def recompute_settings(kind: str, num_layers: int = 1) -> dict[str, object]:
    """megatron's recompute settings for a ``model.recompute`` kind."""
    if kind not in RECOMPUTE:
        raise ValueError(f"unknown recompute kind {kind!r}; known: {sorted(RECOMPUTE)}")
    return RECOMPUTE[kind](num_layers)


def layer_spec(transformer_impl: str = "auto", dims: ModelDims | None = None, config=None):
    """Transformer Engine's layer spec, or megatron's local spec with torch SDPA as core attention
    (see megarl.models.attention), as ``transformer_impl`` resolves on this machine
    (:func:`megarl.backends.resolve_transformer_impl`; ``auto``: TE where CUDA and TE are
    present). The two name a layer's norm weights differently; megarl.models.hf_map knows both.

    With ``config`` (this stage's TransformerConfig) the local spec comes as a whole block whose
    norms, the final one included, accept sequence parallelism (:mod:`megarl.models.norm`)."""
    impl = resolve_transformer_impl(transformer_impl)  # errors before megatron's specs import
    from megatron.core.models.gpt import gpt_layer_specs

    grouped = kernel_options(impl, this_machine()).moe_grouped_gemm
    family_opts = dims.model_family.layer_spec_options(dims, grouped) if dims is not None else {}
    if impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**family_opts)
    from megatron.core.transformer.identity_op import IdentityOp

    from megarl.models.attention import SDPACoreAttention

    use_cached_rotary()  # the local spec's unfused rope, without its per-layer cos/sin and copy
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **family_opts)
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if config is None:
        return spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    attention = spec.submodules.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):  # Qwen3's per-head q/k norms, where present
        if getattr(attention, name, None) not in (None, IdentityOp):
            setattr(attention, name, SequenceParallelTorchNorm)
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config, pp_rank=parallel.pp_rank()),
        layer_norm=SequenceParallelTorchNorm,
    )


def build_gpt_model(
    dims: ModelDims, layout: ParallelLayout, role: str = "actor", opts: ModelOptions | None = None
):
    """An unloaded (zero-initialised) GPTModel for this rank's pipeline stage."""
    from megatron.core.models.gpt import GPTModel

    if role not in ROLES:
        raise ValueError(f"unknown model role {role!r}; known: {ROLES}")
    opts = opts or ModelOptions()
    config = transformer_config(dims, layout, opts)
    pre, post = parallel.is_first_stage(), parallel.is_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(opts.transformer_impl, dims, config),
        vocab_size=dims.vocab_size,
        max_sequence_length=dims.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=dims.tie_word_embeddings and not has_scalar_head(role),
        position_embedding_type="rope",
        rotary_base=int(dims.rope_theta),
        rope_scaling=dims.rope_scaling_factor is not None,
        rope_scaling_factor=dims.rope_scaling_factor or 8.0,
    )
    _mark_tensor_parallel_params(model, dims)
    _cast_params(model, config.params_dtype)
    # megatron makes its linear weights on the current CUDA device, but the local spec's norms
    # and a few buffers on the CPU: the whole model goes to the process device.
    device = platform.device()
    model.to(device)
    if has_scalar_head(role) and post:
        head = SCALAR_HEADS[role]
        model.output_layer = ValueHead(
            dims.hidden_size, config.params_dtype, device=device, bias=head.bias
        )
        model.output_layer.fresh_init(head)
    if role == "reference":
        model.requires_grad_(False)
        model.eval()
    return model


@torch.no_grad()
def _cast_params(model, dtype: torch.dtype) -> None:
    """Every parameter in ``dtype``: the local spec's RMSNorm weights come out float32 in a bf16
    model (Transformer Engine's and Hugging Face's are bf16). One dtype per model keeps the
    checkpoint and the weight reshard (which sizes its buffers by dtype) uniform. Buffers such as
    rotary frequencies are left alone."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _mark_tensor_parallel_params(model, dims: ModelDims) -> None:
    """Tag TP-split weights the way megatron's initialisers would.

    With ``perform_initialization=False`` (weights come from the checkpoint) megatron-core 0.16
    skips ``set_tensor_model_parallel_attributes`` for linear and embedding weights; grad-norm
    clipping would then count only TP rank 0's shards. The tags come from the HF name map.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    index = NameIndex(dims)
    for name, param in model.named_parameters():
        tm, _ = index.lookup(name)
        if tm.tp_dim is not None and not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=tm.tp_dim, stride=1)


def build_model(
    hf_dir: str | Path,
    layout: ParallelLayout,
    role: str = "actor",
    opts: ModelOptions | None = None,
    load: bool = True,
):
    """Build this rank's shard of an actor/critic/reference/reward model and load it from ``hf_dir``.

    Validates the layout against the checkpoint first (clear error on impossible TP/PP). A scalar
    head (critic, reward) is loaded when ``hf_dir`` holds one of that role (a token- or
    sequence-classification folder); from a causal LM it starts fresh (see megarl.models.heads).
    """

    dims = ModelDims.from_pretrained(hf_dir)
    layout.check_model(dims.shape)
    model = build_gpt_model(dims, layout, role, opts)
    if load:
        announce(f"loading the {role}'s weights from {hf_dir}")
        load_hf_into_model(model, hf_dir, dims, layout, role=role)
    return model, dims
