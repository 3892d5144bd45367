"""Typed run config: YAML + overrides, one default per setting, errors that name the fix."""

from __future__ import annotations

import pytest

from megarl.config import RunConfig, load_config, to_flat_dict, validate
from megarl.errors import ConfigError

BASE = ["model.path=/models/x", "data.train_files=[a.parquet]"]


def test_defaults_overrides_and_yaml(tmp_path):
    cfg = load_config(overrides=[*BASE, "actor.optim.lr=3e-6", "parallel.tp=2"])
    assert isinstance(cfg, RunConfig)
    assert cfg.actor.optim.lr == 3e-6 and cfg.parallel.tp == 2
    assert cfg.algorithm.clip_ratio_c is None and cfg.rollout.n == 5  # None: the loss's default
    yaml = tmp_path / "run.yaml"
    yaml.write_text(
        "model:\n  path: /m\ndata:\n  train_files: [t.parquet]\n  train_batch_size: 8\nactor:\n  ppo_mini_batch_size: 4\n"
    )
    cfg = load_config(yaml, ["rollout.n=2"])
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.rollout.n) == (8, 4, 2)
    flat = to_flat_dict(cfg)
    assert flat["actor.optim.lr"] == 1e-6 and flat["model.path"] == "/m"


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(
        ConfigError, match=r"unknown setting 'actor.optim.lrr'.*did you mean actor.optim.lr"
    ):
        load_config(overrides=[*BASE, "actor.optim.lrr=1"])


def test_wrong_type_and_missing_required():
    with pytest.raises(ConfigError, match=r"setting 'rollout.n'"):
        load_config(overrides=[*BASE, "rollout.n=many"])
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
