"""A run's config from its YAML file and ``key=value`` overrides, merged onto the schema,
checked and validated; and the flat ``key -> value`` view trackers log."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from megarl.config.moved_keys import MOVED_KEYS
from megarl.config.schema import RunConfig
from megarl.config.validation import validate
from megarl.config.words import choice_fields, expected_value
from megarl.config_keys import move_keys, prepare_layer, unknown_keys_error
from megarl.errors import ConfigError
from megarl.verl_keys import translate_verl_values


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Merge YAML + ``key=value`` overrides onto the defaults; validate; return a RunConfig."""
    with _config_errors():
        merged = merged_config(path, overrides)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(
                f"required settings missing: {missing}; set them in the YAML or as key=value"
            )
        cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    validate(cfg)
    return cfg


def merged_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> DictConfig:
    """The schema's defaults with the YAML file and the overrides merged on, keys and types
    checked; required settings may still be missing, nothing is validated yet."""
    schema = OmegaConf.structured(RunConfig)
    layers = []
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {file} does not exist")
        try:
            layers.append((OmegaConf.load(file), str(file)))
        except Exception as e:  # yaml errors come in several types
            raise ConfigError(f"cannot parse {file}: {e}") from e
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
    # Hydra's "+key=value" (add a key) and "++key=value" mean a plain override here.
    dotlist = [item.lstrip("+") for item in overrides]
    layers.append((OmegaConf.from_dotlist(dotlist), "the command line overrides"))
    with _config_errors():
        checked = [_checked_layer(layer, source) for layer, source in layers]
        return cast(DictConfig, OmegaConf.merge(schema, *checked))


@contextmanager
def _config_errors() -> Iterator[None]:
    """OmegaConf's errors as ConfigErrors naming the setting (and its valid words)."""
    try:
        yield
    except ConfigKeyError as e:
        raise unknown_keys_error(RunConfig, [str(e.full_key)], "the config", MOVED_KEYS) from None
    except ValidationError as e:
        allowed = choice_fields(RunConfig).get(str(e.full_key))
        if allowed is not None:  # a word outside a Literal field's set
            raise ConfigError(f"{e.full_key}={e.value!r} is not one of {list(allowed)}") from None
        # OmegaConf's message; its first line names the problem, the rest are its internals
        problem = str(e.msg).splitlines()[0] if str(e.msg).strip() else "invalid value"
        wanted = expected_value(str(e.full_key))
        fix = f"; {e.full_key} takes {wanted}" if wanted else ""
        raise ConfigError(f"setting {e.full_key!r}: {problem}{fix}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(str(e)) from None


def _checked_layer(layer: Any, source: str) -> Any:
    """A config layer with its keys checked against the schema (settings that moved taken at
    their new keys, every unknown one named, with megarl's key for verl's), single values taken
    as one-element lists where lists go, and verl's -1 for "never" in the frequencies both spell
    alike read as megarl's 0."""
    tree = OmegaConf.to_container(layer, resolve=False)
    if not isinstance(tree, dict):
        raise ConfigError(f"{source} is not a mapping of sections (model:, data:, ...)")
    move_keys(cast(dict[str, object], tree), MOVED_KEYS, source)  # e.g. rollout.n, before the split
    # A YAML mapping's keys: a key that is not a str is reported unknown like any other.
    unknown = prepare_layer(RunConfig, cast(dict[str, Any], tree))
    if unknown:
        raise unknown_keys_error(RunConfig, unknown, source, MOVED_KEYS)
    translate_verl_values(cast(dict[str, Any], tree))  # verl's -1 (never) -> megarl's 0
    return OmegaConf.create(tree)


def to_flat_dict(cfg: RunConfig) -> dict[str, Any]:
    """Dotted key -> value, e.g. for MLflow params."""
    container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)

    def walk(node: Any, prefix: str) -> dict[str, Any]:
        if isinstance(node, dict):
            out: dict[str, Any] = {}
            for k, v in node.items():
                out.update(walk(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: node}

    return walk(container, "")
