"""Settings that moved, and where to: the flat ``rollout.*`` keys of earlier configs now live in
the rollout's sections by concern (``rollout.sampling``, ``rollout.engine``,
``rollout.placement``, ``rollout.environment``). Every YAML file, resolved ``config.yaml`` of an
earlier run and ``key=value`` override written with the old keys still loads: each layer's old
keys are moved to their new places before the schema checks it (:func:`megarl.config_keys.move_keys`).
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass

from megarl.config.schema import RolloutConfig


def _rollout_section_keys() -> dict[str, str]:
    """``rollout.<setting>`` -> ``rollout.<section>.<setting>`` for every setting of every
    section of :class:`RolloutConfig`: the sections were split out of it whole."""
    moved: dict[str, str] = {}
    for section in fields(RolloutConfig):
        cls = section.default_factory
        if not (isinstance(cls, type) and is_dataclass(cls)):
            continue
        for setting in fields(cls):
            moved[f"rollout.{setting.name}"] = f"rollout.{section.name}.{setting.name}"
    return moved


MOVED_KEYS: dict[str, str] = _rollout_section_keys()
"""Old dotted key -> the key it is now."""
