"""Optional packages that megarl's libraries import for features a run never uses.

Some of a rank's start-up costs are packages imported "in case" (measured on 2 cores with
``python -X importtime``): transformers imports scikit-learn with its generation utilities, which
every ``AutoTokenizer`` brings in (about 0.8 s; only assisted decoding uses it), SciPy with
its object-detection losses and vLLM with its audio resampling (about 0.9 s together; megarl
trains neither), and
megatron-core imports Weights & Biases with its inference engine (about 0.6 s; megarl trains
through megatron and logs through its own loggers), and vLLM's engine imports Ray for an executor
megarl does not use (about 0.5 s), OpenCV for video inputs and OpenTelemetry for request tracing
(about 0.1 s together). Each library decides once, when it is first
imported or first asks, whether the package is installed; hiding the package at that moment
(:func:`packages_hidden`) leaves it out for the library, and only for the library: afterwards it
imports as usual for anything else (megarl's W&B logger, a user's reward function).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

# The packages and the libraries' optional uses of them that megarl does not need.
TRANSFORMERS_OPTIONAL = ("sklearn", "scipy")
MEGATRON_OPTIONAL = ("wandb",)
# vLLM's engine imports Ray for its Ray executor (about 0.5 s; megarl runs vLLM in the rank),
# SciPy for audio inputs and OpenCV for video inputs (megarl's prompts are text), and
# OpenTelemetry with its gRPC exporter for request tracing, which megarl never turns on.
VLLM_OPTIONAL = ("ray", "scipy", "cv2", "opentelemetry")


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
    """Let transformers settle that scikit-learn and SciPy are absent (it caches the answers)."""
    with packages_hidden(TRANSFORMERS_OPTIONAL):
        from transformers.utils import import_utils

        import_utils.is_sklearn_available()
        import_utils.is_scipy_available()


def import_megatron_lean() -> None:
    """Import megatron-core without the packages of :data:`MEGATRON_OPTIONAL`."""
    with packages_hidden(MEGATRON_OPTIONAL):
        import megatron.core  # noqa: F401


def import_vllm_lean() -> None:
    """Import vLLM's engine (``vllm.LLM``) without the packages of :data:`VLLM_OPTIONAL`.

    vLLM's configuration imports transformers' generation utilities, which import scikit-learn
    (and with it SciPy) when transformers has found it installed: with SciPy hidden that import
    fails ("'scipy' is not a package"). So transformers settles first (:func:`import_transformers_lean`,
    a no-op where it has decided already) and its generation utilities are imported outside the
    hidden block, as transformers decided (with scikit-learn only where it had found it)."""
    import_transformers_lean()
    from transformers.generation import GenerationMixin  # noqa: F401

    with packages_hidden(VLLM_OPTIONAL):
        from vllm import LLM  # noqa: F401
