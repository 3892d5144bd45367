"""Where the old logprobs come from (``actor.old_log_prob_forward``), and the rollout dtype
setting (``rollout.engine.dtype``): which runs may take the update's own logprobs as the old ones, and
the actor loss built either way."""

from __future__ import annotations

import pytest
import torch

from megarl.config import load_config, rollout_dtype
from megarl.errors import ConfigError
from megarl.trainer.batch import Samples
from megarl.trainer.old_log_probs import separate_forward_reasons
from megarl.trainer.token_tensors import MissingTokenTensor
from tests.policy_terms import from_update as update_is_old
from tests.policy_terms import policy_terms

pytestmark = pytest.mark.unit

# one mini-batch of the whole batch, one epoch: exactly one optimizer step per batch
ONE_STEP = [
    "model.path=/models/x",
    "data.train_files=[a.parquet]",
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=8",
]


def test_auto_takes_the_update_logprobs_only_when_the_batch_gets_one_step():
    assert update_is_old(load_config(overrides=ONE_STEP))
    # each of these needs the old logprobs before (or apart from) the update's forward
    for extra, reason in [
        (["actor.old_log_prob_forward=always"], "old_log_prob_forward=always"),
        (["actor.ppo_epochs=2"], "actor.ppo_epochs=2"),
        (["actor.ppo_mini_batch_size=4"], "ppo_mini_batch_size < data.train_batch_size"),
        (["algorithm.rollout_correction=token_tis"], "algorithm.rollout_correction=token_tis"),
        (["algorithm.use_kl_in_reward=true"], "use_kl_in_reward"),
        (["actor.lora.rank=4", "actor.lora.dropout=0.1"], "actor.lora.dropout"),
    ]:
        cfg = load_config(overrides=[*ONE_STEP, *extra])
        assert not update_is_old(cfg), extra
        assert any(reason in r for r in separate_forward_reasons(cfg.algorithm, cfg.actor, 8)), (
            extra,
            reason,
        )
    # what leaves the old logprobs equal to the update's: adapters without dropout, a critic,
    # dynamic sampling (the trained groups are still one mini-batch)
    for extra in (
        ["actor.lora.rank=4"],
        ["algorithm.adv_estimator=gae", "algorithm.use_kl_loss=false"],
        ["algorithm.filter_groups=true"],
    ):
        assert update_is_old(load_config(overrides=[*ONE_STEP, *extra])), extra


def test_bad_switch_values_stop_before_launch():
    with pytest.raises(ConfigError, match=r"actor.old_log_prob_forward='never' is not one of"):
        load_config(overrides=[*ONE_STEP, "actor.old_log_prob_forward=never"])
    with pytest.raises(
        ConfigError,
        match=r"rollout.engine.dtype='bf16' is not one of \['auto', 'float32', 'bfloat16'\]",
    ):
        load_config(overrides=[*ONE_STEP, "rollout.engine.dtype=bf16"])


def test_rollout_dtype_auto_follows_the_model():
    for model, rollout, cuda, want in [
        ("float32", "auto", False, "float32"),
        ("bfloat16", "auto", False, "bfloat16"),
        ("bfloat16", "float32", True, "float32"),
        ("float32", "bfloat16", False, "bfloat16"),
        ("auto", "auto", False, "float32"),  # the models' auto: fp32 on CPU ...
        ("auto", "auto", True, "bfloat16"),  # ... bf16 on CUDA
        ("auto", "float32", True, "float32"),
    ]:
        cfg = load_config(
            overrides=[*ONE_STEP, f"model.dtype={model}", f"rollout.engine.dtype={rollout}"]
        )
        assert rollout_dtype(cfg.model, cfg.rollout.engine, cuda) == want, (model, rollout, cuda)


def _batch() -> tuple[Samples, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    responses = [torch.randint(1, 50, (n,), generator=gen).tolist() for n in (3, 7, 1, 5)]
    s = Samples.from_sequences([[1, 2, 3]] * 4, responses, [0, 0, 1, 1], pad_id=0, device="cpu")
    shape = s.response_mask.shape
    s.tensors.advantages = torch.randn(shape[0], 1, generator=gen).expand(shape).clone()
    s.tensors.ref_log_prob = -torch.rand(shape, generator=gen)
    return s, -torch.rand(shape, generator=gen) - 0.5


def test_actor_loss_with_the_update_logprobs_equals_the_loss_with_them_given():
    """The loss built for a one-step run (old = the update's logprobs, detached) equals the loss of
    a run given the same numbers as old logprobs, gradient included, and hands the logprobs back
    under the name old_log_prob; a run that needs a separate forward still requires them."""
    samples, logp_values = _batch()
    one_step = load_config(overrides=ONE_STEP)
    from_update = policy_terms(one_step)
    always = load_config(overrides=[*ONE_STEP, "actor.old_log_prob_forward=always"])
    separate = policy_terms(always)
    logp = logp_values.clone().requires_grad_()
    loss, metrics = from_update(logp, None, samples)
    loss.backward()
    given = samples.select(range(samples.size))
    given.tensors.old_log_prob = logp_values.clone()
    logp_ref = logp_values.clone().requires_grad_()
    loss_ref, metrics_ref = separate(logp_ref, None, given)
    loss_ref.backward()
    assert loss.item() == pytest.approx(loss_ref.item(), abs=1e-7)
    assert torch.allclose(logp.grad, logp_ref.grad, atol=1e-7)
    assert logp.grad.abs().sum() > 0
    assert torch.equal(metrics["old_log_prob"], logp_values)
    assert not metrics["old_log_prob"].requires_grad
    assert "old_log_prob" not in metrics_ref
    assert metrics["actor/ratio_max"] == 1.0 and metrics["actor/ratio_min"] == 1.0
    with pytest.raises(MissingTokenTensor, match="old_log_prob"):
        separate(logp_ref, None, samples)
