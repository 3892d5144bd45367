"""A dense family megarl does not ship, added through its ModelFamily alone (for the family tests).

``FakeDenseForCausalLM`` is the tiny Qwen2's trunk (q/k/v bias, untied head) under GPT-2-like
tensor names, so nothing but its family can map it. :func:`fake_dense_dir` writes it from the tiny
Qwen2's tensors; :func:`registered` adds the family for the length of a ``with`` block (a worker
process calls :func:`register` once).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

from megarl.models.families import ModelFamily, register_family, unregister_family
from megarl.models.families.dense import HFNames, dense_tensor_maps

ARCH = "FakeDenseForCausalLM"
NAMES = HFNames(
    embed="transformer.wte.weight",
    layer="transformer.h.{layer}.",
    input_norm="ln_1.weight",
    qkv_weight="attn.{p}.weight",
    qkv_bias="attn.{p}.bias",
    qk_norm="attn.{ln}_ln.weight",
    o_proj="attn.out.weight",
    post_attn_norm="ln_2.weight",
    gate="mlp.w_gate.weight",
    up="mlp.w_up.weight",
    down="mlp.w_down.weight",
    final_norm="transformer.ln_f.weight",
    lm_head="head.weight",
)
FAMILY = ModelFamily(
    name="fakedense",
    architectures=(ARCH,),
    tensor_maps=lambda dims, role: dense_tensor_maps(dims, role, NAMES),
    qkv_bias=lambda cfg: True,
    roles=("actor", "reference"),
    description="a test-only dense family",
)

# Qwen2 HF name -> fake name (the layer index kept).
_RENAMES = [
    (r"^model\.embed_tokens\.weight$", NAMES.embed),
    (r"^model\.norm\.weight$", NAMES.final_norm),
    (r"^lm_head\.weight$", NAMES.lm_head),
    (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", "transformer.h.{0}." + NAMES.input_norm),
    (
        r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$",
        "transformer.h.{0}." + NAMES.post_attn_norm,
    ),
    (
        r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.weight$",
        "transformer.h.{0}.attn.{1}.weight",
    ),
    (r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.bias$", "transformer.h.{0}.attn.{1}.bias"),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.weight$", "transformer.h.{0}." + NAMES.o_proj),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.weight$", "transformer.h.{0}." + NAMES.gate),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.weight$", "transformer.h.{0}." + NAMES.up),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.weight$", "transformer.h.{0}." + NAMES.down),
]


def fake_name(qwen2_name: str) -> str:
    for pattern, template in _RENAMES:
        m = re.match(pattern, qwen2_name)
        if m:
            return template.format(*m.groups())
    raise KeyError(qwen2_name)


def register() -> None:
    register_family(FAMILY)


@contextlib.contextmanager
def registered() -> Iterator[ModelFamily]:
    register_family(FAMILY)
    try:
        yield FAMILY
    finally:
        unregister_family(FAMILY.name)


def fake_dense_dir(out: Path, qwen2_dir: Path) -> Path:
    """The tiny Qwen2's tensors under the fake names, with a ``FakeDenseForCausalLM`` config."""
    from safetensors.torch import save_file

    from megarl.models.safetensors_io import SafetensorsReader

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    reader = SafetensorsReader(qwen2_dir)
    save_file(
        {fake_name(n): reader.read(n).contiguous() for n in reader.names()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    cfg = json.loads((qwen2_dir / "config.json").read_text())
    cfg.update(architectures=[ARCH], model_type="fakedense")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
