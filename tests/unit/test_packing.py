"""Sequence packing's pure parts: the pack layout, the position map, the token budget, and the
parameter offload of the roles around the rollout."""

from __future__ import annotations

import json

import pytest
import torch

from megarl.config import RunConfig
from megarl.errors import ConfigError
from megarl.models.packing import pack, packed_positions, token_counts
from megarl.parallel import ParallelLayout
from megarl.trainer.batch import Samples, micro_batches
from megarl.trainer.rollout_offload import RoleOffload


def _padded(lengths: list[int], width: int) -> torch.Tensor:
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1) + 100 * i
    return ids


def test_pack_lays_sequences_end_to_end_with_restarting_positions():
    ids = _padded([3, 1, 5], 5)
    packed = pack(ids, torch.tensor([3, 1, 5]))
    assert packed.input_ids.tolist() == [[1, 2, 3, 101, 201, 202, 203, 204, 205]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4]]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 9]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.max_seqlen == 5 and packed.offsets.tolist() == [0, 3, 4]


def test_pack_pads_to_the_sequence_parallel_multiple_as_its_own_segment():
    packed = pack(_padded([3, 2], 3), torch.tensor([3, 2]), multiple=4)
    assert packed.num_tokens == 8
    assert packed.input_ids[0, 5:].tolist() == [0, 0, 0]
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 8]  # the pad tail attends only to itself


def test_packed_positions_map_padded_positions_and_clamp_fillers_to_their_sequence():
    packed = pack(_padded([3, 1, 5], 5), torch.tensor([3, 1, 5]))
    positions = torch.tensor([[1, 2, 3], [0, 1, 2], [2, 3, 4]])
    mapped = packed_positions(packed, positions)
    # row 0: positions 1, 2 and a filler clamped to its last token (2); row 1 has one token
    assert mapped.tolist() == [[1, 2, 2], [3, 3, 3], [6, 7, 8]]
    assert torch.equal(packed.input_ids[0, mapped[2]], _padded([3, 1, 5], 5)[2, 2:5])


def test_pack_refuses_lengths_outside_the_rows():
    with pytest.raises(ValueError, match="sequence lengths"):
        pack(_padded([3], 3), torch.tensor([4]))
    with pytest.raises(ValueError, match="sequence lengths"):
        pack(_padded([3], 3), torch.tensor([0]))


def test_token_budget_counts_real_tokens_when_packed():
    assert token_counts([10, 100, 5], packed=False) == 300
    assert token_counts([10, 100, 5], packed=True) == 115
    prompts = [[1, 2]] * 4
    responses = [[3] * n for n in (2, 3, 4, 60)]
    samples = Samples.from_sequences(prompts, responses, [0, 1, 2, 3], 0, "cpu")
    padded = micro_batches(samples, range(4), 4, max_tokens=70, packed=False)
    packed = micro_batches(samples, range(4), 4, max_tokens=70, packed=True)
    # padded: the 62-token row alone fills the budget; packed: 4 + 5 + 6 + ... fit together
    assert [rows for rows, _ in padded] == [[0, 1, 2], [3]]
    assert [rows for rows, _ in packed] == [[0, 1, 2], [3]]
    tight = micro_batches(samples, range(4), 4, max_tokens=77, packed=True)
    assert [rows for rows, _ in tight] == [[0, 1, 2, 3]]
    assert [r for r, _ in micro_batches(samples, range(4), 4, 77, packed=False)] == [
        [0, 1, 2],
        [3],
    ]


def test_role_offload_round_trip_is_exact_and_reports_bytes_and_seconds():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()  # Adam's states exist only after a step: listed at offload time
    from megarl.models.offload import model_tensors

    tensors = lambda: model_tensors(model, opt)  # noqa: E731
    before = [t.detach().clone() for t in tensors()]
    # every distinct storage once (the optimizer lists the parameters again)
    distinct = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors()}
    roles = RoleOffload({"critic": tensors})
    metrics = roles.offload()
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors())
    expected = sum(distinct.values())
    assert expected > 4 * 8 * 4 * 3  # weights, grads and two Adam moments at least
    assert metrics["offload/critic_bytes"] == float(expected)
    assert metrics["offload/critic_offload_s"] >= 0.0
    assert roles.offload() == {}  # already out
    back = roles.onload()
    assert set(back) == {"offload/critic_onload_s"}
    assert all(torch.equal(t, b) for t, b in zip(tensors(), before, strict=True))
    assert roles.onload() == {}


def test_param_offload_settings_default_off():
    cfg = RunConfig()
    assert not cfg.actor.param_offload and not cfg.critic.param_offload
    assert not cfg.ref.param_offload
    assert cfg.actor.packing and cfg.actor.balance_dp_tokens


def test_plan_sizes_packed_activations_by_the_mean_length():
    """The planner's memory follows packing: the layers' activations scale with the mean real
    sequence length; the loss's outputs keep the padded rows."""
    from megarl.plan import GPU_BF16, Options, Workload, estimate_memory, resolve_model

    _, dims = resolve_model("Qwen2.5-7B")
    layout = ParallelLayout.for_world(8, tp=2)
    workload = Workload(seq_len=4096, micro_batch=2, global_batch=64, mean_seq_len=1024)
    padded = estimate_memory(dims, layout, workload, GPU_BF16, Options(packing=False))
    packed = estimate_memory(dims, layout, workload, GPU_BF16, Options(packing=True))
    fb = "forward-backward"
    pad_act = padded.stages[0].phase_items[fb]["activations"]
    pack_act = packed.stages[0].phase_items[fb]["activations"]
    assert pack_act < pad_act / 2
    # no mean length given: packing gains nothing in the plan
    plain = Workload(seq_len=4096, micro_batch=2, global_batch=64)
    same = [
        estimate_memory(dims, layout, plain, GPU_BF16, Options(packing=p)).peak
        for p in (True, False)
    ]
    assert same[0] == same[1]
    with pytest.raises(ConfigError, match="--mean-seq-len"):
        Workload(seq_len=128, mean_seq_len=200)


def test_plan_json_overrides_name_packing_and_param_offload(capsys):
    from megarl.cli import main

    argv = [
        "plan",
        "--model",
        "Qwen2.5-7B",
        "--gpus",
        "8",
        "--seq-len",
        "4096",
        "--mean-seq-len",
        "1024",
    ]
    assert main([*argv, "--param-offload", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    best = plan["feasible"][0]
    assert best["packing"] is True  # packing never costs memory or time in the plan
    for setting in ("actor.packing=true", "actor.param_offload=true", "ref.param_offload=true"):
        assert setting in best["overrides"], best["overrides"]
    for override in best["overrides"]:  # every override names a real setting
        node = RunConfig()
        for part in override.split("=")[0].split("."):
            assert hasattr(node, part), override
            node = getattr(node, part)


def test_plan_filters_sequence_parallel_and_packing_by_config_words(capsys):
    from megarl.cli import main

    argv = ["plan", "--model", "Qwen2.5-7B", "--gpus", "8", "--tp", "2", "--pp", "1", "--json"]
    assert main([*argv, "--sequence-parallel", "off", "--packing", "off"]) == 0
    off = json.loads(capsys.readouterr().out)["feasible"][0]
    assert "parallel.sequence_parallel=false" in off["overrides"]
    assert "actor.packing=false" in off["overrides"] and off["packing"] is False
    assert main([*argv, "--sequence-parallel", "on"]) == 0
    on = json.loads(capsys.readouterr().out)["feasible"][0]
    assert "parallel.sequence_parallel=true" in on["overrides"]
    # sequence parallelism splits the hidden-size activations over TP: less memory
    assert on["items_gib"]["activations"] < off["items_gib"]["activations"]
