"""Routing replay's pieces (actor.router_replay): the HF rollout engine records each token's
experts as the routers chose them (checked against a teacher-forced transformers forward of the
whole sequence), the replay object's choice and counts, the token order a router sees (padded,
packed, sequence-parallel shares), the routes carried through micro-batches, dynamic sampling
and the data-parallel re-deal, and the input checks."""

from __future__ import annotations

import pytest
import torch

from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.models.dims import ModelDims
from megarl.models.forward import ROUTING_FLAGS
from megarl.models.packing import pack, packed_values
from megarl.models.router_replay import ReplayedRouting, TokenFlags, router_token_order
from megarl.rollout import mismatch
from megarl.rollout.hf_rollout import HFRollout
from megarl.rollout.rollout_types import EngineConfig, SamplingConfig
from megarl.run.checks import _check_moe_options
from megarl.trainer.batch import Samples, padded_routes
from megarl.trainer.dynamic_sampling import concat_samples
from megarl.trainer.old_log_probs import rollout_mismatch
from megarl.trainer.routing_flags import (
    AGREED,
    FLIPPED,
    UNRECORDED,
    fill_response_flags,
    position_codes,
)
from tests.assets import tiny_char_llama_dir, tiny_char_qwen3_moe_dir
from tests.distributed.router_replay_workers import natural_routes

pytestmark = pytest.mark.unit


def test_the_hf_engine_records_each_tokens_experts_as_a_full_forward_routes_them():
    """Sampled responses (2 per prompt, generated incrementally with a KV cache): each token's
    recorded experts equal those transformers' routers choose when the whole sequence is read
    at once (up to one near-tie that the two orders of rounding split differently); the last
    token, never read by the engine, is -1."""
    folder = tiny_char_qwen3_moe_dir()
    engine = HFRollout(folder, config=EngineConfig(record_routes=True))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=6, n=2, seed=3))
    assert len(out.routes) == 4
    differ = total = 0
    for k, routes in enumerate(out.routes):
        prompt = prompts[out.prompt_index[k]]
        ids = torch.tensor([prompt + out.token_ids[k]])
        assert routes.dtype == torch.int16 and routes.shape[0] == ids.shape[1]
        assert bool((routes[-1] == -1).all())
        full = natural_routes(engine.model, ids)[0]  # [tokens, layers, k]
        mine = routes[:-1].long().sort(dim=-1).values
        theirs = full[:-1].long().sort(dim=-1).values
        differ += int((mine != theirs).any(dim=-1).sum())
        total += mine.shape[0] * mine.shape[1]
    # decode and a whole-sequence forward round differently: a router's near-tie may flip once;
    # a record off by a token or a layer would differ on about half of them
    assert total > 50 and differ <= 1, (differ, total)
    dense = HFRollout(tiny_char_llama_dir(), config=EngineConfig(record_routes=False))
    assert dense.generate([[5, 6]], SamplingConfig(max_new_tokens=2)).routes == []
    with pytest.raises(ValueError, match="no MoE router"):
        HFRollout(tiny_char_llama_dir(), config=EngineConfig(record_routes=True))


def topk(scores, k, num_groups=None, group_topk=None):
    return torch.topk(scores, k=k, dim=1)


def test_replay_uses_the_recorded_experts_and_counts_agreement():
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.6, 0.1, 0.2, 0.1], [0.3, 0.2, 0.5, 0.1]])
    replay = ReplayedRouting()
    # token 0: the router's own set {1, 2} in another order; token 1: another set; token 2: none
    replay.set_target(torch.tensor([[2, 1], [3, 1], [-1, -1]], dtype=torch.int16))
    probs, used = replay.get_replay_topk(scores, 2, default_compute_topk=topk)
    assert used.tolist() == [[2, 1], [3, 1], [2, 0]]
    assert probs.tolist() == scores.gather(1, used).tolist()
    assert (replay.counts.tokens, replay.counts.router_agrees, replay.counts.used_agrees) == (
        2,
        1,
        2,
    )
    replay.replay = False  # measure only: the router's own experts
    _, used = replay.get_replay_topk(scores, 2, default_compute_topk=topk)
    assert used.tolist() == topk(scores, 2)[1].tolist()
    assert replay.counts.used_agrees == 3  # 2 + token 0 only
    replay.set_target(None)
    assert not replay.recompute_queue
    with pytest.raises(ValueError, match="3 recorded tokens"):
        replay.set_target(torch.zeros(3, 2, dtype=torch.int16))
        replay.get_replay_topk(scores[:2], 2, default_compute_topk=topk)


def test_a_routers_token_order_padded_packed_and_per_sequence_parallel_rank():
    # routes[b, s, 1 layer, 1] = 10 * b + s, so each value names its token
    b, s = 2, 4
    routes = (10 * torch.arange(b)[:, None] + torch.arange(s)[None, :]).reshape(b, s, 1, 1)
    order = router_token_order(routes, sequence_parallel_rank=None, sequence_parallel_size=1)
    assert order.flatten().tolist() == [0, 10, 1, 11, 2, 12, 3, 13]  # sequence-major
    second = router_token_order(routes, sequence_parallel_rank=1, sequence_parallel_size=2)
    assert second.flatten().tolist() == [2, 12, 3, 13]
    ids = torch.arange(8).reshape(2, 4)
    lens = torch.tensor([3, 2])
    packed = pack(ids, lens, multiple=2)
    values = packed_values(routes, lens, multiple=2, fill=-1)
    assert packed.input_ids.flatten().tolist() == [0, 1, 2, 4, 5, 0]
    assert values.flatten().tolist() == [0, 1, 2, 10, 11, -1]


def _samples(n: int, width: int, tag: int) -> Samples:
    samples = Samples.from_sequences(
        [[1, 2]] * n, [[3] * (width - 2)] * n, list(range(n)), 0, "cpu"
    )
    samples.routes = padded_routes([torch.full((width, 2, 2), tag, dtype=torch.int16)] * n, width)
    return samples


def test_routes_follow_samples_through_selection_and_concatenation():
    a, b = _samples(2, 4, 1), _samples(1, 6, 2)
    both = concat_samples([a, b], pad_id=0)
    assert both.routes is not None and both.routes.shape == (3, 6, 2, 2)
    assert both.routes[0, :4].eq(1).all() and both.routes[0, 4:].eq(-1).all()
    assert both.routes[2].eq(2).all()
    picked = both.select([2])
    assert picked.routes is not None and picked.routes.shape == (1, 6, 2, 2)
    assert picked.routes.eq(2).all()


def test_router_replay_is_refused_where_the_routing_is_not_carried():
    moe = ModelDims.from_pretrained(tiny_char_qwen3_moe_dir())
    dense = ModelDims.from_pretrained(tiny_char_llama_dir())

    def check(dims, *overrides):
        cfg = load_config("configs/quickstart_cpu.yaml", ["actor.router_replay=true", *overrides])
        _check_moe_options(cfg.model, cfg.rollout, cfg.actor, dims)

    check(moe, "rollout.engine.backend=hf")
    # multi-turn and agent trajectories carry their routing (test_router_replay_trajectories.py)
    check(moe, "rollout.engine.backend=hf", "rollout.env=tests/e2e/relay_env.py:Relay")
    check(moe, "rollout.engine.backend=hf", "rollout.agent=agent.py:solve")
    async_hf = (
        "rollout.engine.backend=hf",
        "rollout.placement.mode=async",
        "parallel.rollout_ranks=1",
    )
    check(moe, *async_hf)
    # partial rounds merge their records; shared-prompt packs replay a prompt's experts once
    # (test_router_replay_trajectories.py, tests/distributed/test_router_replay.py)
    check(moe, *async_hf, "rollout.placement.partial=true")
    check(moe, "rollout.engine.backend=hf", "actor.share_prompts=true")
    for dims, overrides, message in (
        (dense, ("rollout.engine.backend=hf",), "dense"),
        (
            moe,
            ("rollout.engine.backend=vllm",),
            "vLLM's routed experts yet .vLLM 0.32 returns them only from its V2 model runner",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            check(dims, *overrides)


@pytest.mark.parametrize(
    ("v2_runner", "refusal"),
    ((None, "requires Model Runner V2"), ("1", "Model Runner V2 requires Triton")),
)
def test_the_installed_vllm_returns_no_routed_experts_on_this_cpu_build(
    monkeypatch, v2_runner, refusal
):
    """Why rollout.engine.backend=vllm with replay is refused: the installed vLLM's routed experts come
    only from its V2 model runner, and its CPU build starts that runner only with Triton's CPU
    backend. When a vLLM upgrade lifts this, the test fails: read CompletionOutput.routed_experts
    ([tokens, layers, top-k]) in the vLLM engine and drop the refusal."""
    from vllm.engine.arg_utils import EngineArgs

    if v2_runner is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2_runner)
    engine_args = EngineArgs(
        model=str(tiny_char_qwen3_moe_dir()),
        enable_return_routed_experts=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
    )
    with pytest.raises(ValueError, match=refusal):
        engine_args.create_engine_config()


def test_each_response_token_is_flagged_by_the_routing_of_the_position_before_it():
    """A micro-batch's per-position flags (as the routers mark them, in their token order) reach
    the samples' response space at the position that predicts each token, in the rows of its
    micro-batch."""
    samples = Samples.from_sequences([[1, 2], [3]], [[4, 5, 6], [7, 8]], [0, 1], 0, "cpu")
    inputs, mbs = [], []
    for row, flipped_position in ((1, 1), (0, 2)):  # the micro-batches in reverse row order
        mb = samples.select([row])
        width = int(mb.input_ids.shape[1])
        order = torch.arange(width).flip(0)  # the routers see the tokens in another order
        flags = TokenFlags.over(order, width)
        recorded = torch.ones(width, dtype=torch.bool)  # every token, in the routers' order
        flags.mark(recorded, order != flipped_position)
        inputs.append({ROUTING_FLAGS: flags})
        mbs.append(([row], mb))
    out = torch.zeros(samples.response_mask.shape, dtype=torch.int32)
    fill_response_flags(out, mbs, inputs)
    # row 0: prompt of 2, token j predicted at position 1 + j; row 1: prompt of 1, at j
    assert out[0].tolist() == [AGREED, FLIPPED, AGREED]
    assert out[1][:2].tolist() == [AGREED, FLIPPED]
    partial = TokenFlags.over(torch.arange(4), 4)
    partial.mark(torch.tensor([True, False, True, False]), torch.tensor([False, True]))
    assert position_codes(partial, (1, 4)).tolist() == [[FLIPPED, UNRECORDED, AGREED, UNRECORDED]]


def test_the_moe_mismatch_splits_into_agreed_and_flipped_tokens(monkeypatch):
    monkeypatch.setattr(mismatch.dist, "all_reduce", lambda *args, **kwargs: None)  # one rank
    samples = Samples.from_sequences([[1], [2]], [[3, 4, 5], [6, 7]], [0, 1], 0, "cpu")
    samples.tensors.rollout_log_prob = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -9.0]])
    samples.tensors.old_log_prob = torch.tensor([[-1.1, -1.2, -1.3], [-1.4, -1.8, 0.0]])
    flags = torch.tensor([[AGREED, UNRECORDED, FLIPPED], [FLIPPED, UNRECORDED, FLIPPED]])
    m = rollout_mismatch(samples, True, flags)  # row 1's last token is padding: not counted
    assert m["rollout/logprob_diff_mean"] == pytest.approx(0.36)
    assert m["rollout/moe_logprob_diff_mean_agreed"] == pytest.approx(0.1)
    assert m["rollout/moe_logprob_diff_max_agreed"] == pytest.approx(0.1)
    assert m["rollout/moe_logprob_diff_mean_flipped"] == pytest.approx(0.35)
    assert m["rollout/moe_logprob_diff_max_flipped"] == pytest.approx(0.4)
    assert m["rollout/moe_flipped_tokens"] == pytest.approx(2 / 3)  # of the 3 recorded
    assert not any("agreed" in k for k in rollout_mismatch(samples, True))  # nothing recorded
    assert not any("moe" in k for k in rollout_mismatch(samples, False, flags))  # dense
