"""Mixture-of-experts families (Qwen3-MoE, Mixtral): dims from their HF configs, the tensor map
with per-expert weights against the HF files at every expert-TP x EP split, megatron's MoE
options, published sizes, and the errors for layouts and configs megarl refuses."""

from __future__ import annotations

import pytest
import torch

from megarl.errors import LayoutError, UnsupportedModelError
from megarl.models.dims import ModelDims, expert_offset, read_hf_config
from megarl.models.hf_map import NameIndex, hf_to_megatron_shard, megatron_shards_to_hf
from megarl.models.safetensors_io import SafetensorsReader
from megarl.parallel import ParallelLayout
from megarl.plan.known_models import resolve_model
from tests.assets import tiny_mixtral_dir, tiny_qwen3_dir, tiny_qwen3_moe_dir

pytestmark = pytest.mark.unit

MOE_DIRS = [tiny_qwen3_moe_dir, tiny_mixtral_dir]


@pytest.mark.parametrize("make_dir", MOE_DIRS)
def test_moe_dims_and_megatron_options(make_dir):
    dims = ModelDims.from_pretrained(make_dir())
    assert dims.is_moe and dims.num_experts == 4 and dims.moe_topk == 2
    assert dims.moe_ffn_hidden_size == 32
    # Qwen3-MoE's tiny config keeps transformers' default norm_topk_prob=False; Mixtral always
    # renormalises: megatron's pre-softmax router is the un-renormalised one.
    qwen = dims.family == "qwen3_moe"
    assert dims.moe_norm_topk is not qwen and dims.qk_layernorm is qwen
    opts = dims.model_family.megatron_options(dims)
    assert opts["num_moe_experts"] == 4 and opts["moe_router_topk"] == 2
    assert opts["moe_ffn_hidden_size"] == 32
    assert opts["moe_router_pre_softmax"] is qwen
    assert opts["moe_expert_capacity_factor"] is None  # no token dropping
    assert dims.model_family.layer_spec_options(dims) == {
        "qk_layernorm": qwen,
        "num_experts": 4,
        "moe_grouped_gemm": False,
    }
    reader = SafetensorsReader(make_dir())
    assert dims.num_parameters == sum(reader.read(n).numel() for n in reader.names())


@pytest.mark.parametrize("make_dir", MOE_DIRS)
@pytest.mark.parametrize(("etp", "ep"), [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
def test_moe_tensor_map_round_trips_every_expert(make_dir, etp, ep):
    """Each EP rank's experts (local index -> global) and their expert-TP shards, from the HF
    files and back: bit-identical, and every HF tensor seen exactly once per layer and expert."""
    model_dir = make_dir()
    dims = ModelDims.from_pretrained(model_dir)
    reader = SafetensorsReader(model_dir)
    local = dims.num_experts // ep
    seen: list[str] = []
    for ep_rank in range(ep):
        index = NameIndex(dims, expert_offset=expert_offset(dims, ep_rank, ep))
        for tm in dims.model_family.tensor_maps(dims, "actor"):
            experts = range(local) if tm.per_expert else [None]
            layers = range(dims.num_layers) if tm.per_layer else [None]
            if not tm.per_expert and ep_rank > 0:
                continue  # the dense part: every EP rank holds the same
            for layer in layers:
                for e in experts:
                    name = tm.megatron.format(layer=layer, expert=e)
                    tm2, hf_names = index.lookup(name)
                    assert tm2 == tm
                    tp = etp if tm.per_expert else 1
                    shards = [
                        hf_to_megatron_shard(tm, hf_names, reader, dims, r, tp) for r in range(tp)
                    ]
                    assert all(tuple(s.shape) == tm.shard_shape(tp) for s in shards), name
                    for hf_name, tensor in megatron_shards_to_hf(tm, hf_names, shards, dims):
                        assert torch.equal(tensor, reader.read(hf_name)), hf_name
                        seen.append(hf_name)
    assert sorted(seen) == sorted(reader.names())


def test_expert_names_map_local_to_global_indices():
    dims = ModelDims.from_pretrained(tiny_mixtral_dir())
    index = NameIndex(dims, layer_offset=2, expert_offset=expert_offset(dims, 1, 2))
    _, hf = index.lookup("decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight")
    assert hf == (
        "model.layers.3.block_sparse_moe.experts.3.w1.weight",
        "model.layers.3.block_sparse_moe.experts.3.w3.weight",
    )
    _, hf = index.lookup("decoder.layers.0.mlp.router.weight")
    assert hf == ("model.layers.2.block_sparse_moe.gate.weight",)


def test_known_moe_models_plan_with_their_published_sizes():
    name, dims = resolve_model("Qwen/Qwen3-30B-A3B")
    assert name == "Qwen3-30B-A3B" and dims.family == "qwen3_moe" and dims.num_experts == 128
    assert 30.3e9 < dims.num_parameters < 30.7e9  # published: 30.5B
    _, mixtral = resolve_model("Mixtral-8x7B")
    assert 46.5e9 < mixtral.num_parameters < 46.9e9  # published: 46.7B


# -- bad input, refused before launch ---------------------------------------------------------


def test_ep_must_divide_the_experts():
    shape = ModelDims.from_pretrained(tiny_qwen3_moe_dir()).shape  # 4 experts
    ParallelLayout(dp=4, ep=4).check_model(shape)
    with pytest.raises(LayoutError, match=r"does not divide the model's 4 experts.*valid ep"):
        ParallelLayout(dp=3, ep=3).check_model(shape)


def test_ep_must_divide_dp():
    with pytest.raises(LayoutError, match="must divide the data-parallel size dp=3"):
        ParallelLayout(dp=3, ep=2)


def test_ep_on_a_dense_model_is_refused():
    shape = ModelDims.from_pretrained(tiny_qwen3_dir()).shape
    with pytest.raises(LayoutError, match="needs a mixture-of-experts model"):
        ParallelLayout(dp=2, ep=2).check_model(shape)


def test_unknown_architecture_lists_the_moe_families():
    with pytest.raises(UnsupportedModelError) as err:
        ModelDims.from_hf_config({"architectures": ["DeepseekV3ForCausalLM"]})
    for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(err.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mlp_only_layers": [1]}, "decoder_sparse_step=1 and mlp_only_layers"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=1 and mlp_only_layers"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok <= the number of experts"),
    ],
)
def test_unsupported_qwen3_moe_configs(change, message):
    cfg = {**read_hf_config(tiny_qwen3_moe_dir()), **change}
    with pytest.raises(UnsupportedModelError, match=message):
        ModelDims.from_hf_config(cfg)


def test_mixtral_router_jitter_is_refused():
    cfg = {**read_hf_config(tiny_mixtral_dir()), "router_jitter_noise": 0.1}
    with pytest.raises(UnsupportedModelError, match="router_jitter_noise"):
        ModelDims.from_hf_config(cfg)


# -- the reshard schedule with experts ---------------------------------------------------------------


@pytest.mark.parametrize("make_dir", MOE_DIRS)
@pytest.mark.parametrize(("tp", "pp", "dp", "ep"), [(1, 1, 4, 2), (2, 1, 2, 2), (1, 2, 2, 2)])
def test_reshard_schedule_delivers_every_expert_once(make_dir, tp, pp, dp, ep):
    """Every HF tensor (per-expert names included) reaches every rank whole, and each rank
    receives exactly the bytes it does not hold (expert weights only from their EP rank)."""
    from megarl.weights.execute import hf_output_shapes
    from megarl.weights.reshard_schedule import schedule_reshard
    from megarl.weights.tensor_list import actor_planned_tensors

    model_dir = make_dir()
    dims = ModelDims.from_pretrained(model_dir)
    reader = SafetensorsReader(model_dir)
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep)
    specs = actor_planned_tensors(dims, layout.layers_per_stage(dims.num_layers), ep=ep)
    plan = schedule_reshard(specs, tp, pp, dp, infer_tp=1, bucket_bytes=32 << 10, ep=ep)
    assert hf_output_shapes(plan, dims) == {n: reader.shape(n) for n in reader.names()}
    experts = [s for s in specs if s.expert_rank is not None]
    assert {s.expert_rank for s in experts} == set(range(ep))
    for rank in range(layout.world_size):
        assert plan.recv_bytes(rank) == plan.min_recv_bytes(rank) > 0
        for bucket in plan.for_rank(rank):
            for op in bucket.ops:
                spec = plan.specs[op.slice.tensor]
                if op.kind != "recv" and spec.expert_rank is not None:
                    # only ranks of the expert's EP rank copy or send it
                    assert layout.coords(rank)[1] % ep == spec.expert_rank


@pytest.mark.parametrize("make_config", ["qwen3_moe", "mixtral"])
def test_hf_rollout_takes_per_expert_weights_into_fused_experts(make_config, tmp_path):
    """The HF rollout backend holds transformers' fused experts; a weight update in checkpoint
    names (per expert, as the reshard sends them) of another model's tensors makes it that model:
    logits equal to the other model loaded by transformers (bit for bit)."""
    from transformers import AutoModelForCausalLM

    from megarl.rollout.hf_rollout import HFRollout
    from tests.assets import randomize_, tiny_mixtral_config, tiny_qwen3_moe_config

    config = {"qwen3_moe": tiny_qwen3_moe_config, "mixtral": tiny_mixtral_config}[make_config]()
    dirs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize_(model, seed)
        model.save_pretrained(tmp_path / str(seed))
        dirs.append(tmp_path / str(seed))
    rollout = HFRollout(dirs[0])
    other = SafetensorsReader(dirs[1])
    rollout.update_weights((n, other.read(n)) for n in other.names())
    target = AutoModelForCausalLM.from_pretrained(dirs[1], dtype=torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(rollout.model(ids).logits, target(ids).logits)


def test_micro_batches_split_to_an_agreed_count():
    """EP > 1: data-parallel ranks run as many micro-batches (their MoE all-to-alls pair up);
    a rank with fewer splits its largest ones, order and rows kept."""
    from megarl.trainer.ep_micro_batches import split_to_count

    groups = [[0, 1, 2, 3], [4], [5, 6]]
    assert split_to_count(groups, 3) == groups
    out = split_to_count(groups, 5)
    assert out == [[0], [1], [2, 3], [4], [5, 6]]
    assert [r for g in out for r in g] == list(range(7))
    with pytest.raises(ValueError, match="cannot make"):
        split_to_count([[0], [1]], 3)


def test_router_losses_need_moe_and_lora_needs_a_dense_model():
    from megarl.config import load_config
    from megarl.errors import ConfigError
    from megarl.run.checks import _check_moe_options

    def sections(path, *overrides):  # what _check_moe_options reads
        base = [f"model.path={path}", "data.train_files=[x.parquet]"]
        c = load_config(overrides=[*base, *overrides])
        return c.model, c.rollout, c.actor

    moe, dense = tiny_qwen3_moe_dir(), tiny_qwen3_dir()
    moe_dims, dense_dims = ModelDims.from_pretrained(moe), ModelDims.from_pretrained(dense)
    _check_moe_options(*sections(moe, "model.moe_aux_loss_coeff=0.01"), moe_dims)
    _check_moe_options(*sections(dense, "actor.lora.rank=8"), dense_dims)
    with pytest.raises(ConfigError, match=r"model.moe_aux_loss_coeff.*dense.*remove it"):
        _check_moe_options(*sections(dense, "model.moe_aux_loss_coeff=0.01"), dense_dims)
    with pytest.raises(ConfigError, match=r"mixture-of-experts.*actor.lora.rank=0"):
        _check_moe_options(*sections(moe, "actor.lora.rank=8"), moe_dims)
