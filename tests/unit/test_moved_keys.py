"""Settings that moved into the rollout's sections still load under their old keys: in a YAML
file (nested, as earlier configs and earlier runs' config.yaml wrote them) and as overrides."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from megarl.config import RunConfig, load_config
from megarl.config.loading import merged_config
from megarl.config.moved_keys import MOVED_KEYS
from megarl.config.words import choice_fields
from megarl.config_keys import all_keys
from megarl.errors import ConfigError

pytestmark = pytest.mark.unit

BASE = ["model.path=/m", "data.train_files=[/d.parquet]"]


def _default(key: str) -> object:
    return OmegaConf.select(OmegaConf.structured(RunConfig), key)


def _other_value(key: str) -> object:
    """A value of ``key``'s type that is not its default, so the check sees where it went."""
    default = _default(key)
    words = choice_fields(RunConfig).get(key)
    if words is not None:
        return next(w for w in words if w != default)
    section, name = key.rsplit(".", 1)
    cls: object = RunConfig
    for part in section.split("."):
        cls = typing.get_type_hints(cls)[part]
    hint = typing.get_type_hints(cls)[name]
    if hint is bool:
        return not default
    if hint is float:
        return float(default) + 0.25  # type: ignore[arg-type]
    return 7 if default is None else int(default) + 3  # type: ignore[call-overload]


def _nested(key: str, value: object) -> dict[str, object]:
    tree: dict[str, object] = {}
    node = tree
    *path, name = key.split(".")
    for part in path:
        node = typing.cast(dict[str, object], node.setdefault(part, {}))
    node[name] = value
    return tree


def test_every_old_key_names_a_setting_of_the_schema_and_is_no_longer_one():
    keys = set(all_keys(RunConfig))
    assert len(MOVED_KEYS) == 26  # the four sections' settings, each moved whole
    assert not [old for old in MOVED_KEYS if old in keys]
    assert not [new for new in MOVED_KEYS.values() if new not in keys]
    assert {new.split(".")[1] for new in MOVED_KEYS.values()} == {
        "sampling",
        "engine",
        "placement",
        "environment",
    }


def test_each_old_key_loads_from_a_file_and_from_an_override(tmp_path: Path):
    """All 26 at once, each at a value other than its default: a file (nested under rollout:,
    as an earlier run's config.yaml) and the overrides (rollout.X=value) each put every value at
    the setting's new key."""
    values = {old: _other_value(new) for old, new in MOVED_KEYS.items()}
    file_tree: dict[str, object] = {"rollout": {}}
    for old, value in values.items():
        typing.cast(dict[str, object], file_tree["rollout"])[old.split(".")[1]] = value
    config = tmp_path / "old.yaml"
    config.write_text(yaml.safe_dump(file_tree))
    overrides = [f"{old}={yaml.safe_dump(v).splitlines()[0]}" for old, v in values.items()]
    from_file = merged_config(config, BASE)
    from_overrides = merged_config(None, [*BASE, *overrides])
    for old, new in MOVED_KEYS.items():
        assert values[old] != _default(new), new
        assert OmegaConf.select(from_file, new) == values[old], (old, new)
        assert OmegaConf.select(from_overrides, new) == values[old], (old, new)


def test_an_old_key_and_its_new_key_in_one_layer_are_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"rollout\.n and rollout\.sampling\.n are one setting"):
        load_config(overrides=[*BASE, "rollout.n=3", "rollout.sampling.n=4"])
    config = tmp_path / "both.yaml"
    config.write_text(
        yaml.safe_dump({"rollout": {"mode": "async", "placement": {"mode": "async"}}})
    )
    with pytest.raises(ConfigError, match=r"keep rollout\.placement\.mode"):
        load_config(config, BASE)


def test_layers_written_with_old_and_new_keys_merge_in_order(tmp_path: Path):
    """A file with the old keys, overridden on the command line with the new ones (and the other
    way round): the later layer wins, as for any setting."""
    old_file = tmp_path / "old.yaml"
    old_file.write_text(yaml.safe_dump({"rollout": {"n": 3, "temperature": 0.5}}))
    cfg = load_config(old_file, [*BASE, "rollout.sampling.n=6"])
    assert (cfg.rollout.sampling.n, cfg.rollout.sampling.temperature) == (6, 0.5)
    new_file = tmp_path / "new.yaml"
    new_file.write_text(yaml.safe_dump(_nested("rollout.engine.backend", "hf")))
    cfg = load_config(new_file, [*BASE, "rollout.backend=vllm", "rollout.max_turns=2"])
    assert (cfg.rollout.engine.backend, cfg.rollout.environment.max_turns) == ("vllm", 2)


def test_a_misspelt_old_key_is_answered_with_the_new_key():
    with pytest.raises(
        ConfigError, match=r"'rollout\.tempreature'; did you mean rollout\.sampling\.temperature"
    ):
        load_config(overrides=[*BASE, "rollout.tempreature=0.5"])
    with pytest.raises(ConfigError, match=r"did you mean rollout\.placement\.max_staleness"):
        load_config(overrides=[*BASE, "rollout.placement.max_stalness=0"])


def test_an_old_key_beside_a_section_given_a_value_is_refused():
    with pytest.raises(ConfigError, match=r"rollout\.sampling is a section of settings"):
        load_config(overrides=[*BASE, "rollout.sampling=3", "rollout.n=4"])
