"""HF -> megatron dist checkpoint (TP2xPP2) -> HF round trips, reloads at other layouts, and the
exported folders in transformers and the CPU vLLM.

One 4-rank run converts every tiny model at TP2xPP2, reloads each checkpoint at TP1 (DP4), PP4 and
(where the heads allow) TP4 next to the same model built straight from the HF folder, and exports
it back with the ranks sharing the files. The real SmolLM2-135M goes through PP2 (TP1xPP2xDP2):
its 9 attention heads rule TP2 out (TP3 also fits; PP2 is the cheaper layout on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megarl.models.safetensors_io import SafetensorsReader
from tests import fake_family
from tests.assets import (
    randomize_,
    smollm2_dir,
    tiny_llama_dir,
    tiny_qwen2_config,
    tiny_qwen2_dir,
    tiny_qwen3_dir,
    tiny_qwen3_tied_dir,
)
from tests.mp import run_gloo
from tests.vllm_generate import assert_vllm_generates_like_transformers

# One xdist worker (make test runs two): one 4-rank conversion (the `tiny` fixture) is
# checked by every test here.
pytestmark = pytest.mark.xdist_group("checkpoints_roundtrip")

ROOT = Path(__file__).resolve().parents[2]
BATCH_SEED = 7
SMALL_SHARDS = 300_000  # bytes: the tiny exports span several files, shared by the ranks


def fixed_batch(vocab: int, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(
        0, vocab, (batch, seq), generator=torch.Generator().manual_seed(BATCH_SEED)
    )


def _vllm_friendly_qwen2(path: Path) -> Path:
    """A tiny Qwen2 with head_dim 64 (vLLM's CPU attention has no kernel for head_dim 16)."""
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").exists():
        cfg = tiny_qwen2_config(
            hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        randomize_(model, 5)
        model.save_pretrained(path)
    return path


# -- rank-side bodies ---------------------------------------------------------------------------


@torch.no_grad()
def _outputs(model, ids, critic=False):
    from megarl.models.forward import gather_vocab, run_schedule

    outs = run_schedule(
        [model],
        [{"input_ids": ids}],
        lambda out, b: (out.sum() * 0.0, {"out": out if critic else gather_vocab(out)}),
        forward_only=True,
    )
    return outs[0]["out"].detach() if outs else None


def _same_weights(a, b) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def _key_mismatches(model, dims, layout) -> list[str]:
    """Parameters whose dist-checkpoint key megarl computes differently from megatron itself."""
    from megatron.core import parallel_state as ps

    from megarl.checkpoint.keys import dist_checkpoint_key
    from megarl.models.dims import layer_offset
    from megarl.models.hf_map import NameIndex

    index = NameIndex(dims, layer_offset(dims, layout, ps.get_pipeline_model_parallel_rank()))
    sharded = model.sharded_state_dict()
    bad = []
    for name, _ in model.named_parameters():
        if name == "output_layer.weight" and dims.tie_word_embeddings:
            continue  # saved as the embedding (megatron ties it in the checkpoint)
        tm, _ = index.lookup(name)
        if sharded[name].key != dist_checkpoint_key(tm.megatron):
            bad.append(
                f"{name}: megatron {sharded[name].key} vs {dist_checkpoint_key(tm.megatron)}"
            )
    return bad


def _reload_checks(name, hf_dir, ckpt, layouts, out):
    """Checkpoint loaded at each layout == the model built from HF at that layout, bit for bit."""
    from megatron.core import parallel_state as ps

    from megarl.checkpoint import build_model_from_checkpoint
    from megarl.models.build import build_model
    from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel

    for spec in layouts:
        layout = ParallelLayout.for_world(4, **spec)
        initialize_model_parallel(layout)
        from_ckpt, dims, _ = build_model_from_checkpoint(ckpt, layout)
        from_hf, _ = build_model(hf_dir, layout)
        ids = fixed_batch(dims.vocab_size)
        a, b = _outputs(from_ckpt, ids), _outputs(from_hf, ids)
        key = f"{name}:{layout}"
        out[key + ":weights_equal"] = _same_weights(from_ckpt, from_hf)
        out[key + ":keys_equal"] = not _key_mismatches(from_ckpt, dims, layout)
        if a is not None:
            out[key + ":logits_equal"] = bool(torch.equal(a, b))
            if layout.tp == 1 and layout.pp == 1 and ps.get_data_parallel_rank() == 0:
                out[f"{name}:logits"] = a
        destroy_model_parallel()


def _critic_checks(hf_dir, work: Path, out):
    """A critic with a trained-looking value head: save (as a training step), reload at TP1,
    export as token classification, convert that back and export again."""
    import torch.distributed as dist

    from checkpoints_tools.hf_to_mcore import check_hf_source, hf_to_mcore
    from checkpoints_tools.mcore_to_hf import export_to_hf
    from megarl.checkpoint import build_model_from_checkpoint, load_checkpoint, save_step
    from megarl.models.build import build_gpt_model, build_model
    from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel

    def with_head(model):
        head = getattr(model, "output_layer", None)  # only the last pipeline stage has it
        if head is not None:
            gen = torch.Generator().manual_seed(3)
            with torch.no_grad():
                head.weight.copy_(torch.randn(head.weight.shape, generator=gen))
                head.bias.fill_(0.25)
        return model

    layout = ParallelLayout(tp=2, pp=2)
    initialize_model_parallel(layout)
    critic, dims = build_model(hf_dir, layout, role="critic")
    save_step(work / "critic_run", 7, with_head(critic), role="critic", hf_assets=hf_dir)
    destroy_model_parallel()

    layout = ParallelLayout.for_world(4, tp=1)
    initialize_model_parallel(layout)
    loaded, _, meta = build_model_from_checkpoint(work / "critic_run", layout)  # via `latest`
    reference, _ = build_model(hf_dir, layout, role="critic")
    ids = fixed_batch(dims.vocab_size)
    values = _outputs(loaded, ids, critic=True)
    out["critic:role"] = meta.role
    out["critic:step"] = meta.step
    out["critic:weights_equal"] = _same_weights(loaded, with_head(reference))
    if values is not None and dist.get_rank() == 0:
        out["critic:values"] = values
    # An actor checkpoint starts a critic: the trunk loads, the value head is left alone.
    fresh = build_gpt_model(dims, layout, "critic")
    load_checkpoint(work / "qwen2" / "ckpt", fresh, dims=dims, role="critic")
    trunk = {k: v for k, v in reference.named_parameters() if not k.startswith("output_layer")}
    out["critic:trunk_from_actor"] = (
        all(torch.equal(p, trunk[k]) for k, p in fresh.named_parameters() if k in trunk)
        and not fresh.output_layer.weight.any()
    )  # TP1: every rank is the last stage
    destroy_model_parallel()

    export_to_hf(
        work / "critic_run", work / "critic_hf", max_shard_bytes=SMALL_SHARDS, progress=False
    )
    source = check_hf_source(work / "critic_hf", ParallelLayout(tp=2, pp=2))
    out["critic:detected_role"] = source.role
    hf_to_mcore(source, work / "critic_ckpt2", ParallelLayout(tp=2, pp=2))
    export_to_hf(
        work / "critic_ckpt2", work / "critic_hf2", max_shard_bytes=SMALL_SHARDS, progress=False
    )


def _reshard_checks(name, hf_dir, out):
    """Built from HF at TP2xPP2, then resharded by the hybrid engine's planner and executor into
    full HF tensors on every rank (inference TP2): each equals the HF file's tensor."""
    from megarl.models.build import build_model
    from megarl.models.dims import layer_offset
    from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
    from megarl.weights.execute import ReshardExecutor, local_spec_tensors
    from megarl.weights.reshard_schedule import schedule_reshard
    from megarl.weights.tensor_list import actor_planned_tensors

    layout = ParallelLayout(tp=2, pp=2)
    initialize_model_parallel(layout)
    model, dims = build_model(hf_dir, layout)
    rank = torch.distributed.get_rank()
    specs = actor_planned_tensors(dims, layout.layers_per_stage(dims.num_layers))
    plan = schedule_reshard(specs, 2, 2, 1, 2, bucket_bytes=64 << 10)
    offset = layer_offset(dims, layout, rank // (layout.tp * layout.dp))
    received: dict[str, torch.Tensor] = {}
    ReshardExecutor(plan, dims, rank).run(
        local_spec_tensors(model, dims, offset, plan.specs),
        lambda pairs: received.update((n, t.clone()) for n, t in pairs),
    )
    reader = SafetensorsReader(hf_dir)
    out[f"{name}:reshard_equal"] = sorted(received) == sorted(reader.names()) and all(
        torch.equal(received[n], reader.read(n)) for n in received
    )
    destroy_model_parallel()


_TE_LINEARS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


def _te_extra_state(dims, layout) -> dict:
    """The ``_extra_state`` objects a Transformer Engine model adds to its sharded state (FP8
    metadata of each TE linear, per layer and TP rank), as megatron's TE layers shard them."""
    import io

    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megarl.models.dims import layer_offset

    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    first = layer_offset(dims, layout, pp_rank)
    count = layout.layers_per_stage(dims.num_layers)[pp_rank]
    return {
        f"decoder.layers.{i}.{linear}._extra_state": ShardedObject(
            f"decoder.layers.{linear}._extra_state",
            io.BytesIO(b"te-fp8-metadata"),
            (dims.num_layers, layout.tp),
            (first + i, tp_rank),
            replica_id=(0, 0, ps.get_data_parallel_rank()),
        )
        for i in range(count)
        for linear in _TE_LINEARS
    }


def _te_checks(hf_dir, work: Path, out):
    """The two megatron namings (local and Transformer Engine layer specs) on a real model:
    its parameters renamed to TE's names and back; the HF tensors exported from TE-named
    parameters; a checkpoint holding TE's ``_extra_state`` objects loaded into the local spec, and
    a local-spec checkpoint loaded into a model that asks for them (as a TE model does)."""
    from torch.distributed.checkpoint import FileSystemReader

    from megarl.checkpoint import build_model_from_checkpoint, load_checkpoint, save_checkpoint
    from megarl.models.build import build_gpt_model, build_model
    from megarl.models.export import iter_stage_hf_tensors
    from megarl.models.hf_map import state_dict_to_naming
    from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel

    layout = ParallelLayout(tp=2, pp=2)
    initialize_model_parallel(layout)
    model, dims = build_model(hf_dir, layout)
    params = dict(model.named_parameters())
    te = state_dict_to_naming(params, "transformer_engine")
    back = state_dict_to_naming(te, "local")
    stage_layers = layout.layers_per_stage(dims.num_layers)[0]
    out["te:renamed_norms"] = sum(a != b for a, b in zip(params, te, strict=True))
    out["te:expected_norms"] = 2 * stage_layers
    out["te:round_trip_equal"] = list(back) == list(params) and all(
        torch.equal(back[k], params[k]) for k in params
    )

    class TeNamed:  # the actor as a TE-spec model names its parameters
        output_layer = getattr(model, "output_layer", None)

        def named_parameters(self):
            return iter(te.items())

    local_hf = list(iter_stage_hf_tensors(model, dims, layout))
    te_hf = list(iter_stage_hf_tensors(TeNamed(), dims, layout))
    out["te:export_equal"] = [n for n, _ in local_hf] == [n for n, _ in te_hf] and all(
        torch.equal(a, b) for (_, a), (_, b) in zip(local_hf, te_hf, strict=True)
    )
    save_checkpoint(
        work / "te_ckpt",
        model,
        role="actor",
        hf_assets=hf_dir,
        extra={"te": _te_extra_state(dims, layout)},
    )
    destroy_model_parallel()
    keys = FileSystemReader(str(work / "te_ckpt" / "mcore")).read_metadata().state_dict_metadata
    out["te:checkpoint_has_extra_state"] = any("_extra_state" in k for k in keys)

    layout = ParallelLayout.for_world(4, tp=1)
    initialize_model_parallel(layout)
    from_te, _, _ = build_model_from_checkpoint(work / "te_ckpt", layout)
    reference, _ = build_model(hf_dir, layout)
    out["te:te_checkpoint_into_local_equal"] = _same_weights(from_te, reference)
    asks_extra = build_gpt_model(dims, layout, "actor")
    plain = asks_extra.sharded_state_dict
    extras = _te_extra_state(dims, layout)
    asks_extra.sharded_state_dict = lambda *a, **k: {**plain(*a, **k), **extras}
    load_checkpoint(work / "qwen2" / "ckpt", asks_extra, dims=dims, role="actor")
    out["te:local_checkpoint_into_te_equal"] = _same_weights(asks_extra, reference)
    destroy_model_parallel()


# Layout each model is saved at (on 4 ranks: SmolLM2 runs TP1xPP2xDP2, the DP replica writes
# nothing), the layouts it is reloaded at, and the largest exported file.
SAVE_AT = {
    "qwen2": (2, 2),
    "llama": (2, 2),
    "vllm-qwen2": (2, 2),
    "smollm2": (1, 2),
    "qwen3": (2, 2),
    "qwen3-tied": (2, 2),
    "fakedense": (2, 2),
}
RELOAD_AT = {
    "qwen2": [dict(tp=1), dict(pp=4)],
    "llama": [dict(tp=1), dict(pp=4), dict(tp=4)],
    "qwen3": [dict(tp=1)],
    "qwen3-tied": [dict(tp=1)],
    "fakedense": [dict(tp=1)],
}
# Families whose HF -> megatron load is also checked through the hybrid engine's reshard.
RESHARD = ("qwen3", "fakedense")
SHARD_BYTES = {"smollm2": 200 * 2**20}


def roundtrip_worker(rank: int, world: int, work: str, models: dict[str, str]) -> dict:
    from checkpoints_tools.hf_to_mcore import check_hf_source, hf_to_mcore
    from checkpoints_tools.mcore_to_hf import export_to_hf
    from megarl.parallel import ParallelLayout
    from megarl.platform import adapt_megatron_for_cpu

    adapt_megatron_for_cpu()
    fake_family.register()  # a family known through its ModelFamily alone (tests/fake_family.py)
    work_dir = Path(work)
    out: dict = {}
    for name, hf_dir in models.items():
        ckpt = work_dir / name / "ckpt"
        tp, pp = SAVE_AT[name]
        save_layout = ParallelLayout.for_world(world, tp=tp, pp=pp)
        hf_to_mcore(check_hf_source(hf_dir, save_layout), ckpt, save_layout)
        _reload_checks(name, hf_dir, ckpt, RELOAD_AT.get(name, []), out)
        if name in RESHARD:
            _reshard_checks(name, hf_dir, out)
        shard_bytes = SHARD_BYTES.get(name, SMALL_SHARDS)
        export_to_hf(ckpt, work_dir / name / "hf", max_shard_bytes=shard_bytes, progress=False)
        if name == "qwen2":
            _critic_checks(hf_dir, work_dir, out)
            _te_checks(hf_dir, work_dir, out)
    return out


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    work = tmp_path_factory.mktemp("ckpt-roundtrip")
    models = {
        "qwen2": str(tiny_qwen2_dir()),
        "llama": str(tiny_llama_dir()),
        "vllm-qwen2": str(_vllm_friendly_qwen2(work / "vllm-qwen2-src")),
        "smollm2": str(smollm2_dir()),
        "qwen3": str(tiny_qwen3_dir()),
        "qwen3-tied": str(tiny_qwen3_tied_dir()),
        "fakedense": str(fake_family.fake_dense_dir(work / "fakedense-src", tiny_qwen2_dir())),
    }
    results = run_gloo(roundtrip_worker, 4, str(work), models)
    merged: dict = {}
    for r in results:
        for k, v in r.items():
            if k.endswith(("_equal", "trunk_from_actor", "has_extra_state")):
                merged[k] = merged.get(k, True) and v
            else:
                merged.setdefault(k, v)
    return work, models, merged


def _assert_bit_identical(original: Path, exported: Path) -> int:
    """Every tensor of ``original`` is in ``exported`` with the same dtype and bits (and no more)."""
    a, b = SafetensorsReader(original), SafetensorsReader(exported)
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        x, y = a.read(name), b.read(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    return len(a.names())


# -- tests --------------------------------------------------------------------------------------


# HF tensors: Qwen2 has biases and lm_head; Llama is tied (no head); Qwen3 has q/k norms, no
# biases; the fake family is the tiny Qwen2 under other names.
TENSORS = {"qwen2": 51, "llama": 38, "qwen3": 47, "qwen3-tied": 46, "fakedense": 51}


@pytest.mark.parametrize("name", list(TENSORS))
def test_hf_to_tp2pp2_to_hf_is_bit_identical(tiny, name):
    work, models, _ = tiny
    exported = work / name / "hf"
    n = _assert_bit_identical(Path(models[name]), exported)
    assert n == TENSORS[name]
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(p.name for p in exported.glob("*.safetensors")) == files
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg == json.loads((Path(models[name]) / "config.json").read_text())
    assert (exported / "generation_config.json").is_file()


def test_tp2pp2_checkpoint_loads_at_tp1_pp4_tp4_identically(tiny):
    _, _, merged = tiny
    expected = {
        "qwen2": ["TP1xPP1xDP4", "TP1xPP4xDP1"],
        "llama": ["TP1xPP1xDP4", "TP1xPP4xDP1", "TP4xPP1xDP1"],
        "qwen3": ["TP1xPP1xDP4"],
        "qwen3-tied": ["TP1xPP1xDP4"],
        "fakedense": ["TP1xPP1xDP4"],
    }
    for name, layouts in expected.items():
        for layout in layouts:
            assert merged[f"{name}:{layout}:weights_equal"] is True, (name, layout)
            assert merged[f"{name}:{layout}:logits_equal"] is True, (name, layout)
            # and megarl's dist-checkpoint keys (used to stream exports) are megatron's own
            assert merged[f"{name}:{layout}:keys_equal"] is True, (name, layout)


def test_models_load_through_the_hybrid_engine_reshard(tiny):
    """Qwen3 and the family defined only by its ModelFamily: HF -> megatron (TP2xPP2) -> reshard -> the HF tensors."""
    _, _, merged = tiny
    for name in RESHARD:
        assert merged[f"{name}:reshard_equal"] is True, name


@pytest.mark.parametrize("name", ["qwen2", "llama", "qwen3", "qwen3-tied"])
def test_exported_folder_in_transformers_matches_megatron(tiny, name):
    from transformers import AutoModelForCausalLM

    work, _, merged = tiny
    model = AutoModelForCausalLM.from_pretrained(work / name / "hf", dtype=torch.float32).eval()
    megatron_logits = merged[f"{name}:logits"]
    with torch.no_grad():
        logits = model(fixed_batch(model.config.vocab_size)).logits
    assert (logits - megatron_logits).abs().max().item() < 1e-5


def test_critic_round_trips_as_token_classification(tiny):
    from transformers import AutoModelForTokenClassification

    work, _, merged = tiny
    assert merged["critic:role"] == "critic" and merged["critic:step"] == 7
    assert merged["critic:weights_equal"] is True
    assert merged["critic:trunk_from_actor"] is True
    assert merged["critic:detected_role"] == "critic"
    _assert_bit_identical(work / "critic_hf", work / "critic_hf2")
    names = SafetensorsReader(work / "critic_hf").names()
    assert {"score.weight", "score.bias"} <= set(names) and "lm_head.weight" not in names
    model = AutoModelForTokenClassification.from_pretrained(work / "critic_hf", dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForTokenClassification"
    with torch.no_grad():
        values = model.eval()(fixed_batch(model.config.vocab_size)).logits
    assert values.shape[-1] == 1
    assert (values - merged["critic:values"]).abs().max().item() < 1e-5


def test_both_megatron_namings_and_cross_spec_checkpoints(tiny):
    """Local spec <-> Transformer Engine spec (no TE here: its names and checkpoint objects)."""
    _, _, merged = tiny
    assert merged["te:renamed_norms"] == merged["te:expected_norms"] > 0
    assert merged["te:round_trip_equal"] is True
    assert merged["te:export_equal"] is True
    assert merged["te:checkpoint_has_extra_state"] is True
    assert merged["te:te_checkpoint_into_local_equal"] is True
    assert merged["te:local_checkpoint_into_te_equal"] is True


def test_export_in_bfloat16_rounds_each_tensor_once(tiny, tmp_path):
    from checkpoints_tools.mcore_to_hf import export_to_hf

    work, models, _ = tiny
    export_to_hf(work / "qwen2" / "ckpt", tmp_path / "bf16", dtype="bfloat16", progress=False)
    original, exported = SafetensorsReader(models["qwen2"]), SafetensorsReader(tmp_path / "bf16")
    for name in original.names():
        assert torch.equal(exported.read(name), original.read(name).to(torch.bfloat16)), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("name", ["vllm-qwen2", "qwen3"])  # Qwen3: q/k norm, head_dim 32
def test_exported_folder_in_vllm_generates_what_transformers_does(tiny, name):
    work, _, _ = tiny
    assert_vllm_generates_like_transformers(work / name / "hf")


def test_smollm2_through_pp2_is_bit_identical(tiny):
    """The real SmolLM2-135M (tied embeddings, 9 heads / 3 KV heads, so no TP2: PP2 here)."""
    from transformers import AutoTokenizer

    work, models, _ = tiny
    original, exported = Path(models["smollm2"]), work / "smollm2" / "hf"
    assert _assert_bit_identical(original, exported) == 272
    assert len(list(exported.glob("model-*.safetensors"))) == 3  # 514 MiB in 200 MiB files
    with safe_open(str(next(exported.glob("model-*.safetensors"))), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (exported / name).read_bytes() == (original / name).read_bytes(), name
    text = [{"role": "user", "content": "What is 2+2?"}]
    a, b = AutoTokenizer.from_pretrained(original), AutoTokenizer.from_pretrained(exported)
    assert a.apply_chat_template(text) == b.apply_chat_template(text)
