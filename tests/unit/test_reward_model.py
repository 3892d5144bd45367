"""Reward-model pieces without processes: the Bradley-Terry loss against torch's own BCE, pair
micro-batches, the scalar-head roles and their Hugging Face names, and the reward-model config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megarl.algos import bradley_terry_loss
from megarl.config import load_config, validate
from megarl.errors import ConfigError, UnsupportedModelError
from megarl.models.dims import ModelDims
from megarl.models.heads import causal_architecture, head_architecture, hf_folder_role
from megarl.models.hf_map import NameIndex, tensor_maps
from megarl.reward_model.pairs import pair_micro_batches
from megarl.rewards.model import combine_scores, last_token_scores
from tests.assets import tiny_qwen2_reward_dir


def test_bradley_terry_equals_bce_with_a_target_of_one_and_its_gradient():
    gen = torch.Generator().manual_seed(0)
    chosen = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    rejected = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    margin = torch.rand(7, generator=gen, dtype=torch.float64)
    loss, m = bradley_terry_loss(chosen, rejected, margin)
    ref = F.binary_cross_entropy_with_logits(
        chosen - rejected - margin, torch.ones(7, dtype=torch.float64)
    )
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    assert m["accuracy"].item() == pytest.approx(float((chosen > rejected).double().mean()))
    assert torch.autograd.gradcheck(
        lambda c, r: bradley_terry_loss(c, r, 0.5)[0], (chosen, rejected)
    )
    with pytest.raises(ValueError, match="NaN or inf"):
        bradley_terry_loss(torch.tensor([float("nan")]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"\[pairs\]"):
        bradley_terry_loss(torch.zeros(2, 1), torch.zeros(2, 1))


def test_pairs_share_micro_batches_sorted_by_length():
    items = [
        SimpleNamespace(prompt_ids=[1] * p, chosen_ids=[2] * c, rejected_ids=[3] * r)
        for p, c, r in [(5, 9, 1), (2, 1, 1), (3, 2, 4), (1, 1, 1), (4, 4, 4)]
    ]
    mbs = pair_micro_batches(items, pairs_per_micro_batch=2, pad_id=0, device="cpu")
    assert [mb.pairs for mb in mbs] == [2, 2, 1]
    seen = []
    for mb in mbs:
        for row in range(0, mb.input_ids.shape[0], 2):
            c, r = mb.input_ids[row], mb.input_ids[row + 1]
            lc, lr = int(mb.seq_lens[row]), int(mb.seq_lens[row + 1])
            assert set(c[:lc].tolist()) <= {1, 2} and 2 in c[:lc].tolist()  # chosen first
            assert set(r[:lr].tolist()) <= {1, 3} and 3 in r[:lr].tolist()
            assert (c[lc:] == 0).all() and (r[lr:] == 0).all()
            seen.append(max(lc, lr))
    assert seen == sorted(seen)  # the longest pairs come last


def test_last_token_scores_and_combination():
    out = torch.arange(24.0).reshape(2, 4, 3)[..., :1]  # [b=2, s=4, 1]
    assert last_token_scores(out, torch.tensor([2, 4])).tolist() == [3.0, 21.0]
    # pad == EOS (0): a row ending with EOS is read at the token before it, padding is skipped
    ids = torch.tensor([[5, 6, 0, 0], [5, 6, 7, 0]])
    lens = torch.tensor([3, 4])  # row 0: [5, 6, EOS] + pad; row 1: [5, 6, 7, EOS]
    assert last_token_scores(out, lens, ids, pad_id=0).tolist() == [3.0, 18.0]
    rule, model = torch.tensor([1.0, 0.0]), torch.tensor([0.5, -0.5])
    assert combine_scores(rule, model, 0.5, 2.0).tolist() == [1.5, -1.0]
    assert combine_scores(rule, None, 1.0, 2.0).tolist() == [1.0, 0.0]


def test_scalar_head_roles_and_names():
    assert causal_architecture("Qwen2ForSequenceClassification") == "Qwen2ForCausalLM"
    assert causal_architecture("LlamaForTokenClassification") == "LlamaForCausalLM"
    assert head_architecture("LlamaForCausalLM", "reward") == "LlamaForSequenceClassification"
    assert head_architecture("LlamaForCausalLM", "actor") == "LlamaForCausalLM"
    assert (
        hf_folder_role({"architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1})
        == "reward"
    )
    assert (
        hf_folder_role({"architectures": ["Qwen2ForTokenClassification"], "id2label": {"0": "x"}})
        == "critic"
    )
    assert hf_folder_role({"architectures": ["Qwen2ForCausalLM"]}) == "actor"
    with pytest.raises(UnsupportedModelError, match="num_labels=1"):
        hf_folder_role({"architectures": ["Qwen2ForSequenceClassification"], "num_labels": 3})
    dims = ModelDims.from_pretrained(tiny_qwen2_reward_dir())  # a sequence-classification folder
    assert dims.architecture == "Qwen2ForCausalLM"
    heads = {
        tm.megatron: tm.hf for tm in tensor_maps(dims, "reward") if tm.megatron.startswith("output")
    }
    assert heads == {"output_layer.weight": ("score.weight",)}  # no bias, unlike the critic
    critic = {tm.megatron for tm in tensor_maps(dims, "critic") if tm.megatron.startswith("output")}
    assert critic == {"output_layer.weight", "output_layer.bias"}
    assert NameIndex(dims, role="reward").lookup("output_layer.weight")[1] == ("score.weight",)


def test_reward_model_config_is_checked_on_its_own_terms():
    base = ["model.path=/m", "data.train_files=[p.parquet]", "trainer.kind=reward_model"]
    # policy-only checks (mini-batch vs batch) do not apply to a reward model
    cfg = load_config(overrides=[*base, "data.train_batch_size=6"])
    with pytest.raises(ConfigError, match="not divisible by the 4 data-parallel ranks"):
        validate(cfg, world_size=4)
    validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match=r"reward_model\.micro_batch_size must be >= 1"):
        load_config(overrides=[*base, "reward_model.micro_batch_size=0"])
    with pytest.raises(ConfigError, match=r"reward_model\.truncation"):
        load_config(overrides=[*base, "reward_model.truncation=cut"])
    with pytest.raises(ConfigError, match=r"trainer\.kind"):
        load_config(overrides=[*base[:2], "trainer.kind=kto"])
    with pytest.raises(ConfigError, match="rule_weight=0 leaves no reward"):
        load_config(overrides=[*base[:2], "reward.rule_weight=0"])


def test_reward_model_path_errors_name_the_fix(tmp_path):
    from megarl.rewards.model import check_reward_model
    from tests.assets import tiny_qwen2_dir

    check_reward_model(str(tiny_qwen2_reward_dir()), policy_vocab_size=512)  # fine
    with pytest.raises(ConfigError, match="does not exist; train one with `megarl train-rm`"):
        check_reward_model(str(tmp_path / "nothing"), 512)
    with pytest.raises(ConfigError, match="is a causal LM, not a reward model"):
        check_reward_model(str(tiny_qwen2_dir()), 512)
    with pytest.raises(ConfigError, match=r"a vocabulary of 512 tokens, the policy 128"):
        check_reward_model(str(tiny_qwen2_reward_dir()), 128)
