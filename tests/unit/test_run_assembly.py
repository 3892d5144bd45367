"""The pure parts of the run assembly: the algorithm spec resolved from the config, the KL
controller it asks for, endless data epochs, and when a step is saved."""

from __future__ import annotations

import pytest

from megarl.algos import AdaptiveKLController, FixedKLController
from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.metrics import Reduce
from megarl.run.epochs import EpochBatches
from megarl.run.resume import save_due
from megarl.trainer.spec import make_kl_in_reward_controller
from tests.policy_terms import algorithm_spec

pytestmark = pytest.mark.unit

BASE = ["model.path=/models/x", "data.train_files=[a.parquet]"]


def _cfg(*overrides: str):
    return load_config(overrides=[*BASE, *overrides])


def test_grpo_spec_has_a_reference_and_no_critic():
    spec = algorithm_spec(_cfg("algorithm.adv_estimator=grpo", "algorithm.use_kl_loss=true"), 64)
    assert spec.needs_reference and not spec.needs_critic
    assert spec.advantage_inputs == frozenset({"group_ids"})
    assert spec.token_level and not spec.kl_in_reward
    assert spec.update_reductions["actor/ratio_max"] is Reduce.MAX
    assert spec.update_reductions["actor/ratio_min"] is Reduce.MIN


def test_gae_spec_has_a_critic_and_no_reference_without_kl():
    cfg = _cfg(
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_loss=false",
        "algorithm.loss_agg_mode=seq-mean-token-mean",
    )
    spec = algorithm_spec(cfg, 64)
    assert spec.needs_critic and not spec.needs_reference and not spec.token_level
    assert make_kl_in_reward_controller(spec) is None


@pytest.mark.parametrize(
    ("kind", "cls", "value"),
    [("fixed", FixedKLController, 0.3), ("adaptive", AdaptiveKLController, 0.3)],
)
def test_kl_in_reward_controller_gets_the_settings_it_takes(kind, cls, value):
    cfg = _cfg(
        "algorithm.use_kl_in_reward=true", f"algorithm.kl_ctrl={kind}", f"algorithm.kl_coef={value}"
    )
    ctrl = make_kl_in_reward_controller(algorithm_spec(cfg, 64))
    assert isinstance(ctrl, cls) and ctrl.value == value


def test_epoch_batches_start_the_next_epoch_and_refuse_an_empty_dataset():
    batches = EpochBatches([1, 2], "empty")
    assert [batches.next() for _ in range(5)] == [1, 2, 1, 2, 1]
    with pytest.raises(ConfigError, match="fewer prompts"):
        EpochBatches([], "fewer prompts than data.train_batch_size").next()


def test_save_due_every_save_freq_and_at_the_end():
    cfg = _cfg("trainer.total_steps=5", "trainer.save_freq=2")
    assert [s for s in range(1, 6) if save_due(cfg.trainer, s)] == [2, 4, 5]
    cfg = _cfg("trainer.total_steps=5", "trainer.save_freq=0")
    assert [s for s in range(1, 6) if save_due(cfg.trainer, s)] == [5]
