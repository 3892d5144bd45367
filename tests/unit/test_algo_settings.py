"""Algorithm choices and their settings are resolved through the registries before launch: an
unknown name lists the known ones, a setting the chosen function does not take is an error, open
parameters reach registered functions, and group estimators refuse rollout.sampling.n < 2. Through the
CLI each exits 2 before any process starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.algos import POLICY_LOSSES, register_policy_loss
from megarl.algos.choices import AlgorithmKwargs, resolve_algorithm_kwargs
from megarl.cli import main as cli_main
from megarl.config import RunConfig, load_config
from megarl.errors import ConfigError
from megarl.run.checks import check_choices
from megarl.trainer.losses import loss_agg_options

pytestmark = pytest.mark.unit

BASE = ["model.path=/models/x", "data.train_files=[a.parquet]"]
ROOT = Path(__file__).resolve().parents[2]


def cfg_with(*overrides: str):
    """The config as the CLI takes it: loaded, then its registry words checked."""
    cfg = load_config(overrides=[*BASE, *overrides])
    check_choices(cfg)
    return cfg


def resolved(cfg: RunConfig) -> AlgorithmKwargs:
    """The config's algorithm section resolved as each rank's trainer resolves it."""
    return resolve_algorithm_kwargs(cfg.algorithm, cfg.rollout.sampling)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algorithm.policy_loss=ppo_clipp",
            r"algorithm.policy_loss='ppo_clipp'.*known: gspo, ppo_clip",
        ),
        ("algorithm.adv_estimator=grpoo", r"known: gae, grpo, reinforce_plus_plus, rloo"),
        ("algorithm.loss_agg_mode=token_mean", r"known: seq-mean-token-mean, .*token-mean"),
        ("algorithm.kl_loss_estimator=k4", r"known: abs, k1, k2, k3"),
        ("algorithm.kl_ctrl=pid", r"known: adaptive, fixed"),
    ],
)
def test_unknown_names_list_the_known_ones(override, message):
    with pytest.raises(ConfigError, match=message):
        cfg_with(override)


def test_a_setting_the_chosen_function_does_not_take_is_an_error():
    with pytest.raises(
        ConfigError,
        match=r"algorithm.gamma=0.9 is given but algorithm.adv_estimator='grpo' does not take "
        r"'gamma' \(it takes: epsilon, norm_by_std\); remove the setting",
    ):
        cfg_with("algorithm.gamma=0.9")
    with pytest.raises(ConfigError, match=r"algorithm.clip_ratio_c=2.0 is given but .*'gspo'"):
        cfg_with("algorithm.policy_loss=gspo", "algorithm.clip_ratio_c=2.0")
    with pytest.raises(ConfigError, match=r"loss_agg_norm_length=64 .*'token-mean' does not take"):
        cfg_with("algorithm.loss_agg_norm_length=64")
    with pytest.raises(ConfigError, match=r"policy_loss_kwargs has 'clip_ratio'.*it takes: clip"):
        cfg_with("algorithm.policy_loss_kwargs.clip_ratio=0.3")
    with pytest.raises(ConfigError, match=r"'clip_ratio_c' is given twice"):
        cfg_with("algorithm.clip_ratio_c=2.0", "algorithm.policy_loss_kwargs.clip_ratio_c=4.0")
    # a value the function refuses fails here too, not at the first update
    with pytest.raises(ConfigError, match=r"refuses its settings.*clip_ratio_c must be > 1.0"):
        cfg_with("algorithm.clip_ratio_c=0.5")


def test_named_and_open_settings_reach_the_functions():
    kw = resolved(cfg_with("algorithm.clip_ratio_high=0.28"))
    assert kw.policy_loss == {"clip_ratio_high": 0.28}  # the rest: the loss's own defaults
    assert kw.adv_inputs == {"group_ids"}
    kw = resolved(
        cfg_with(
            "algorithm.adv_estimator=gae",
            "algorithm.gamma=0.99",
            "algorithm.adv_estimator_kwargs.whiten=false",
            "algorithm.policy_loss_kwargs.clip_ratio_c=null",  # dual clip off
        )
    )
    assert kw.adv_estimator == {"gamma": 0.99, "whiten": False}
    assert kw.policy_loss == {"clip_ratio_c": None}
    assert kw.adv_inputs == {"values", "batch_sum"}  # its whitening spans every DP rank


def test_a_registered_loss_gets_its_own_parameter_from_the_config():
    name = "test_scaled_pg"
    if name not in POLICY_LOSSES:

        @register_policy_loss(name)
        def scaled_pg(old_log_prob, log_prob, advantages, mask, *, beta: float):
            return -advantages * log_prob * beta, {}

    with pytest.raises(
        ConfigError, match=r"needs \['beta'\]; set them in algorithm.policy_loss_kwargs"
    ):
        cfg_with(f"algorithm.policy_loss={name}")
    cfg = cfg_with(f"algorithm.policy_loss={name}", "algorithm.policy_loss_kwargs.beta=0.5")
    assert resolved(cfg).policy_loss == {"beta": 0.5}


def test_group_estimators_refuse_one_sample_per_prompt():
    for estimator in ("grpo", "rloo"):
        with pytest.raises(
            ConfigError, match=r"rollout.sampling.n=1 gives every sample advantage 0"
        ):
            cfg_with(f"algorithm.adv_estimator={estimator}", "rollout.sampling.n=1")
    cfg_with("algorithm.adv_estimator=gae", "rollout.sampling.n=1")  # a critic needs no group
    with pytest.raises(ConfigError, match=r"filter_groups .* rollout.sampling.n >= 2"):
        cfg_with(
            "algorithm.adv_estimator=gae", "rollout.sampling.n=1", "algorithm.filter_groups=true"
        )


def test_dr_grpo_norm_length_defaults_to_the_response_limit():
    cfg = cfg_with(
        "algorithm.loss_agg_mode=seq-mean-token-sum-norm", "rollout.sampling.max_response_length=96"
    )
    assert loss_agg_options(resolved(cfg))(3) == {"norm_length": 96, "num_seqs": 3}
    cfg = cfg_with(
        "algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.loss_agg_norm_length=40"
    )
    assert loss_agg_options(resolved(cfg))(2) == {"norm_length": 40, "num_seqs": 2}
    assert (
        loss_agg_options(resolved(cfg_with()))(2) == {}
    )  # token-mean: the trainer weighs by tokens


def test_sampling_and_validation_settings_are_checked():
    with pytest.raises(ConfigError, match=r"rollout.sampling.val_n=4 greedy samples"):
        cfg_with("rollout.sampling.val_n=4")
    with pytest.raises(ConfigError, match=r"val_before_train=true needs data.val_files"):
        cfg_with("trainer.val_before_train=true")
    with pytest.raises(ConfigError, match=r"overlong_buffer.len=600 must be in \[0, rollout"):
        cfg_with("reward.overlong_buffer.len=600")
    with pytest.raises(
        ConfigError, match=r"set reward.overlong_buffer.len=0 or rollout.sampling.ignore_eos"
    ):
        cfg_with("rollout.sampling.ignore_eos=true", "reward.overlong_buffer.len=8")
    assert cfg_with("rollout.sampling.ignore_eos=true").rollout.sampling.ignore_eos


def test_bad_algorithm_settings_exit_2_from_the_cli_before_any_process(tmp_path, capsys):
    """Through `megarl train`'s entry in a fresh interpreter once (to see what a user's whole
    command loads), then in-process for the other cases: exit 2, the fix in the message, and no
    model, engine or process library imported before the refusal."""
    run = tmp_path / "run.yaml"
    run.write_text("model:\n  path: /nonexistent/model\ndata:\n  train_files: [a.parquet]\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    entry = (
        "import sys; from megarl.cli import main; rc = main(sys.argv[1:]); "
        "print(sorted(m for m in ('megatron', 'vllm', 'transformers', 'ray') if m in sys.modules)); "
        "sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", entry, "train", str(run), "algorithm.policy_loss=ppo_clipp"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "known: gspo, ppo_clip" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout  # refused before any heavy import
    cases = [
        # unknown names: the known ones in the message
        (["algorithm.adv_estimator=grpoo"], "known: gae, grpo, reinforce_plus_plus, rloo"),
        (["algorithm.loss_agg_mode=token_mean"], "known: seq-mean-token-mean"),
        # a setting the chosen function does not take
        (["algorithm.gamma=0.9"], "remove the setting, or choose another advantage estimator"),
        (["algorithm.adv_estimator_kwargs.lamda=0.9"], "remove it or fix its name"),
        (["algorithm.policy_loss_kwargs.clip_ratio=0.3"], "remove it or fix its name"),
        (["algorithm.loss_agg_norm_length=64"], "does not take"),
        # a group estimator with one sample per prompt
        (["rollout.sampling.n=1"], "set rollout.sampling.n >= 2"),
        (["algorithm.adv_estimator=rloo", "rollout.sampling.n=1"], "set rollout.sampling.n >= 2"),
    ]
    for extra, message in cases:
        assert cli_main(["train", str(run), *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra


def test_tiny_batch_check_uses_the_real_functions():
    # the pre-launch call runs the registered loss: a loss that fails on any input is caught
    name = "test_broken_loss"
    if name not in POLICY_LOSSES:

        @register_policy_loss(name)
        def broken(old_log_prob, log_prob, advantages, mask):
            raise ValueError("broken on purpose")

    with pytest.raises(ConfigError, match="broken on purpose"):
        cfg_with(f"algorithm.policy_loss={name}")
    assert torch.is_tensor(torch.zeros(1))
