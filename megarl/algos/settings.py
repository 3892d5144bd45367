"""Keyword settings of a registered algorithm, resolved against the function's own signature.

A registered function declares its hyperparameters as keyword-only parameters (after the ``*``);
their defaults are the one default of each. Configured values reach a function in two ways: a
named setting (``algorithm.clip_ratio_low``) that maps to one parameter name, or an open mapping
(``algorithm.policy_loss_kwargs``) of parameter names to values. :func:`resolve_kwargs` merges
both and refuses, naming the setting and the fix: an unknown function name, a value for a
parameter the chosen function does not take, and the same parameter given twice.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from megarl.algos.registry import Registry, UnknownNameError


class SettingError(ValueError):
    """A configured algorithm setting that cannot be applied; the message names the fix."""


def keyword_parameters(fn: Callable[..., object]) -> dict[str, inspect.Parameter]:
    """The hyperparameters of a registered function: its keyword-only parameters."""
    return {
        name: p
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def positional_inputs(fn: Callable[..., object]) -> set[str]:
    """Names of the data inputs a function takes positionally (e.g. ``values``, ``group_ids``)."""
    return {
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }


@dataclass(frozen=True)
class Choice:
    """One configured algorithm choice and the values given for it.

    ``named`` maps a parameter name to ``(setting, value)`` for named settings that were given
    (None means "not given": the function's default applies); ``open`` is the open mapping from
    ``open_setting``; ``supplied`` are parameters the trainer passes itself (not configurable).
    """

    setting: str
    registry: Registry
    name: str
    named: Mapping[str, tuple[str, object]] = field(default_factory=dict)
    open: Mapping[str, object] = field(default_factory=dict)
    open_setting: str | None = None
    supplied: frozenset[str] = frozenset()


def lookup(choice: Choice) -> Callable[..., object]:
    try:
        return choice.registry.get(choice.name)
    except UnknownNameError:
        known = ", ".join(choice.registry.names())
        raise SettingError(
            f"{choice.setting}={choice.name!r} is not a registered {choice.registry.kind}; "
            f"known: {known}"
        ) from None


def resolve_kwargs(choice: Choice) -> dict[str, object]:
    """The keyword arguments to call the chosen function with (only the values given)."""
    fn = lookup(choice)
    params = keyword_parameters(fn)
    takes = sorted(p for p in params if p not in choice.supplied)
    takes_text = ", ".join(takes) if takes else "no settings"
    out: dict[str, object] = {}
    for param, (setting, value) in choice.named.items():
        if value is None:
            continue
        if param not in params:
            raise SettingError(
                f"{setting}={value!r} is given but {choice.setting}={choice.name!r} does not take "
                f"{param!r} (it takes: {takes_text}); remove the setting, or choose another "
                f"{choice.registry.kind} that uses it"
            )
        out[param] = value
    where = choice.open_setting or choice.setting
    for param, value in choice.open.items():
        if param not in params or param in choice.supplied:
            raise SettingError(
                f"{where} has {param!r}, which {choice.setting}={choice.name!r} does not take "
                f"(it takes: {takes_text}); remove it or fix its name"
            )
        if param in out:
            named_setting = choice.named[param][0]
            raise SettingError(
                f"{param!r} is given twice: {named_setting} and {where}.{param}; keep one"
            )
        out[param] = value
    missing = [
        p
        for p, spec in params.items()
        if spec.default is inspect.Parameter.empty and p not in out and p not in choice.supplied
    ]
    if missing:
        raise SettingError(f"{choice.setting}={choice.name!r} needs {missing}; set them in {where}")
    return out


def try_on_tiny_batch(
    policy: Choice,
    policy_kwargs: Mapping[str, object],
    estimator: Choice,
    estimator_kwargs: Mapping[str, object],
) -> None:
    """Call the chosen policy loss and advantage estimator once on a 2 x 2 batch, so a value
    they refuse (e.g. ``clip_ratio_c=0.5``) fails before launch rather than at the first update."""

    mask = torch.ones(2, 2)
    zeros = torch.zeros(2, 2)
    inputs = positional_inputs(lookup(estimator))
    extra: dict[str, object] = {}
    if "values" in inputs:
        extra["values"] = zeros
    if "group_ids" in inputs:
        extra["group_ids"] = [0, 0]
    try_call(
        policy,
        lambda: policy.registry.call(policy.name, zeros, zeros, zeros, mask, **policy_kwargs),
    )
    try_call(
        estimator,
        lambda: estimator.registry.call(
            estimator.name, zeros, mask.bool(), **extra, **estimator_kwargs
        ),
    )


def try_call(choice: Choice, call: Callable[[], object]) -> None:
    """Run ``call`` (the chosen function on a tiny batch); a TypeError or ValueError it raises
    becomes a SettingError naming the setting."""
    try:
        call()
    except (TypeError, ValueError) as e:
        given = choice.open_setting or choice.setting
        raise SettingError(
            f"{choice.setting}={choice.name!r} refuses its settings ({given} and the named "
            f"algorithm.* values): {e}"
        ) from None
