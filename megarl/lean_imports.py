"""Optional packages that megarl's libraries import for features a run never uses.

Two of a rank's start-up costs are packages imported "in case" (measured on 2 cores with
``python -X importtime``): transformers imports scikit-learn with its generation utilities, which
every ``AutoTokenizer`` brings in (about 0.8 s; only assisted decoding uses it), and
megatron-core imports Weights & Biases with its inference engine (about 0.6 s; megarl trains
through megatron and logs through its own loggers). Each library decides once, when it is first
imported or first asks, whether the package is installed; hiding the package at that moment
(:func:`packages_hidden`) leaves it out for the library, and only for the library: afterwards it
imports as usual for anything else (megarl's W&B logger, a user's reward function).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

# The packages and the libraries' optional uses of them that megarl does not need.
TRANSFORMERS_OPTIONAL = ("sklearn",)
MEGATRON_OPTIONAL = ("wandb",)


@contextmanager
def packages_hidden(names: Sequence[str]) -> Iterator[None]:
    """Within the block, ``import NAME`` fails as if NAME were not installed (and
    ``importlib.util.find_spec`` says so), for each NAME not imported yet."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # Python's "not importable" marker
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def import_transformers_lean() -> None:
    """Let transformers settle that scikit-learn is absent (it caches the answer)."""
    with packages_hidden(TRANSFORMERS_OPTIONAL):
        from transformers.utils import import_utils

        import_utils.is_sklearn_available()


def import_megatron_lean() -> None:
    """Import megatron-core without the packages of :data:`MEGATRON_OPTIONAL`."""
    with packages_hidden(MEGATRON_OPTIONAL):
        import megatron.core  # noqa: F401
