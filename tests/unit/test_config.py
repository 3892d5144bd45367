"""Typed run config: YAML + overrides, one default per setting, errors that name the fix."""

from __future__ import annotations

import pytest

from megarl.config import RunConfig, load_config, to_flat_dict, validate
from megarl.config.words import expected_value
from megarl.errors import ConfigError
from megarl.run.checks import check_choices

BASE = ["model.path=/models/x", "data.train_files=[a.parquet]"]


def test_defaults_overrides_and_yaml(tmp_path):
    cfg = load_config(overrides=[*BASE, "actor.optim.lr=3e-6", "parallel.tp=2"])
    assert isinstance(cfg, RunConfig)
    assert cfg.actor.optim.lr == 3e-6 and cfg.parallel.tp == 2
    assert (
        cfg.algorithm.clip_ratio_c is None and cfg.rollout.sampling.n == 5
    )  # None: the loss's default
    yaml = tmp_path / "run.yaml"
    yaml.write_text(
        "model:\n  path: /m\ndata:\n  train_files: [t.parquet]\n  train_batch_size: 8\nactor:\n  ppo_mini_batch_size: 4\n"
    )
    cfg = load_config(yaml, ["rollout.sampling.n=2"])
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.rollout.sampling.n) == (
        8,
        4,
        2,
    )
    flat = to_flat_dict(cfg)
    assert flat["actor.optim.lr"] == 1e-6 and flat["model.path"] == "/m"


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(
        ConfigError, match=r"unknown setting 'actor.optim.lrr'.*did you mean actor.optim.lr"
    ):
        load_config(overrides=[*BASE, "actor.optim.lrr=1"])


def test_wrong_type_and_missing_required():
    # one line naming the setting and what it takes, none of the config library's internals
    cases = {
        "rollout.sampling.n=many": "rollout.sampling.n takes a whole number",
        "actor.optim.lr=fast": "actor.optim.lr takes a number",
        "trainer.val_before_train=maybe": "trainer.val_before_train takes true or false",
    }
    for override, takes in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(overrides=[*BASE, override])
        message = str(e.value)
        assert message.startswith(f"setting '{override.split('=')[0]}': ") and takes in message
        assert "\n" not in message and "full_key" not in message, message
    assert expected_value("data.val_files") == "a list of text"
    assert expected_value("parallel.infer_tp") == "a whole number, or null"
    assert expected_value("model.dtype").startswith("one of ")
    with pytest.raises(ConfigError, match=r"required settings missing: \['model.path'\]"):
        load_config(overrides=["data.train_files=[a.parquet]"])


def test_batch_sizes_checked():
    with pytest.raises(
        ConfigError, match=r"ppo_mini_batch_size=64 is larger than data.train_batch_size=32"
    ):
        load_config(overrides=[*BASE, "data.train_batch_size=32", "actor.ppo_mini_batch_size=64"])
    with pytest.raises(ConfigError, match="not a multiple of"):
        load_config(overrides=[*BASE, "data.train_batch_size=30", "actor.ppo_mini_batch_size=8"])
    cfg = load_config(
        overrides=[*BASE, "data.train_batch_size=6", "actor.ppo_mini_batch_size=6", "parallel.tp=2"]
    )
    with pytest.raises(
        ConfigError, match=r"data.train_batch_size=6 is not divisible by the 4 data-parallel ranks"
    ):
        validate(cfg, world_size=8)
    validate(cfg, world_size=6)


def test_choices_and_missing_file(tmp_path):
    with pytest.raises(
        ConfigError, match=r"trainer.resume='sometimes' is not one of \['auto', 'never'\]"
    ):
        load_config(overrides=[*BASE, "trainer.resume=sometimes"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="must look like"):
        load_config(overrides=["model.path"])


def test_profile_steps_are_numbered_from_one():
    with pytest.raises(
        ConfigError, match=r"trainer\.profile_steps=\[0, 3\]: steps are numbered from 1"
    ):
        load_config(overrides=[*BASE, "trainer.profile_steps=[0,3]"])
    assert load_config(overrides=[*BASE, "trainer.profile_steps=[1,3]"]).trainer.profile_steps == [
        1,
        3,
    ]


@pytest.mark.parametrize(
    "setting, fix",
    [
        ("actor.packing=false", "set actor.packing=true"),
        ("model.transformer_impl=transformer_engine", "set model.transformer_impl=local"),
        ("parallel.cp=2", "set parallel.cp=1"),
    ],
)
def test_shared_prompts_refuse_what_cannot_carry_them(setting, fix):
    with pytest.raises(ConfigError, match=f"actor.share_prompts=true with {setting}: {fix}"):
        load_config(overrides=[*BASE, "actor.share_prompts=true", setting])
    assert load_config(overrides=[*BASE, "actor.share_prompts=true"]).actor.share_prompts


ASYNC = [*BASE, "rollout.placement.mode=async", "parallel.rollout_ranks=2"]


def test_async_settings_refused_before_launch():
    """rollout.placement.mode=async and its settings: each bad combination fails at load (or with the
    job's size, before torchrun starts), naming the setting and the fix."""
    cfg = load_config(overrides=ASYNC)
    assert (
        cfg.rollout.placement.mode,
        cfg.rollout.placement.max_staleness,
        cfg.rollout.placement.partial,
    ) == ("async", 1, False)
    validate(cfg, world_size=4)  # 2 rollout ranks + 2 trainers
    cases = [
        ([*BASE, "rollout.placement.mode=async"], "positive multiple of parallel.infer_tp=1"),
        ([*ASYNC, "parallel.infer_tp=4"], "positive multiple of parallel.infer_tp=4"),
        ([*BASE, "parallel.rollout_ranks=2"], "add rollout.placement.mode=async"),
        (
            [*BASE, "rollout.placement.partial=true"],
            "rollout.placement.partial=true continues generation",
        ),
        (
            [*ASYNC, "rollout.placement.max_staleness=-1"],
            "rollout.placement.max_staleness=-1 must be >= 0",
        ),
        (
            [*ASYNC, "rollout.placement.partial_chunk_tokens=0"],
            "partial_chunk_tokens=0 must be >= 1",
        ),
        ([*ASYNC, "actor.param_offload=true"], "trainer ranks hold no rollout engine"),
        ([*ASYNC, "trainer.elastic.max_restarts=2"], "does not yet account for the rollout"),
        ([*BASE, "rollout.placement.mode=later"], "rollout.placement.mode='later' is not one of"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=overrides)
    with pytest.raises(ConfigError, match="leave 0 trainer ranks"):
        validate(cfg, world_size=2)
    with pytest.raises(
        ConfigError, match="leave 1 trainer ranks, which must be a positive multiple of tp"
    ):
        validate(load_config(overrides=[*ASYNC, "parallel.tp=2"]), world_size=3)


def test_async_mode_runs_environments_and_dynamic_sampling_but_not_partial_trajectories():
    """The rollout group runs multi-turn environments and dynamic sampling's draws; partial
    rollouts (single-turn responses continued across weight updates) with an environment stop
    at load, naming both fixes."""
    env = "rollout.env=megarl.envs.examples:CountdownEnv"
    cfg = load_config(overrides=[*ASYNC, env, "algorithm.filter_groups=true"])
    validate(cfg, world_size=4)
    assert cfg.rollout.env.endswith(":CountdownEnv") and cfg.algorithm.filter_groups
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[*ASYNC, env, "rollout.placement.partial=true"])
    message = str(err.value)
    assert "turn by turn" in message
    assert "rollout.placement.partial=false" in message and "unset rollout.env" in message


def test_rollout_corrections_by_name_and_the_old_tis_key():
    cfg = load_config(
        overrides=[
            *BASE,
            "algorithm.rollout_correction=icepop",
            "algorithm.rollout_correction_kwargs={alpha: 0.4, beta: 4.0}",
        ]
    )
    check_choices(cfg)  # the algorithm words, as the CLI checks them after loading
    assert cfg.algorithm.rollout_correction == "icepop"
    for overrides, message in [
        (["algorithm.tis_cap=2.0"], "rollout_correction=token_tis and algorithm"),
        (["algorithm.rollout_correction=tis"], "known: decoupled_ppo, icepop, masked_is, none"),
        (
            [
                "algorithm.rollout_correction=masked_is",
                "algorithm.rollout_correction_kwargs={low: 2, high: 1}",
            ],
            "keeps no ratio",
        ),
        (
            [
                "algorithm.rollout_correction=token_tis",
                "algorithm.rollout_correction_kwargs={alpha: 1}",
            ],
            "has 'alpha', which algorithm.rollout_correction='token_tis' does not take",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_choices(load_config(overrides=[*BASE, *overrides]))


def test_the_supervised_trainers_are_the_same_in_validation_and_in_the_sequence_budget():
    from megarl.config import derived, supervised_validation

    assert set(derived.SUPERVISED_KINDS) == set(supervised_validation.SUPERVISED_VALIDATORS)


def test_verl_minus_one_means_never_for_save_and_test_frequencies(tmp_path):
    from megarl.run.resume import save_due

    verl_yaml = tmp_path / "verl.yaml"
    verl_yaml.write_text("trainer:\n  save_freq: -1\n  test_freq: -1\n  total_steps: 10\n")
    for cfg in (
        load_config(verl_yaml, BASE),
        load_config(
            None, [*BASE, "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.total_steps=10"]
        ),
    ):
        assert (cfg.trainer.save_freq, cfg.trainer.test_freq) == (0, 0)
        # no periodic checkpoint; the final one stays (the export is made from it)
        assert [s for s in range(1, 11) if save_due(cfg.trainer, s)] == [10]
    for key in ("save_freq", "test_freq"):
        with pytest.raises(ConfigError, match=rf"trainer\.{key}=-2 must be >= 0"):
            load_config(None, [*BASE, f"trainer.{key}=-2"])
