"""One spec per model architecture family (see :mod:`megarl.models.specs.base`).

Importing this package registers the built-in families; a new dense family is one module here
(build a :class:`FamilySpec`, ``register_family`` it) plus its import below.
"""

from megarl.models.specs import (  # noqa: F401  (registers the families)
    llama,
    mixtral,
    qwen2,
    qwen3,
    qwen3_moe,
)
from megarl.models.specs.base import (
    Dims,
    FamilySpec,
    TensorMap,
    families,
    family,
    family_for_architectures,
    register_family,
    supported_architectures,
    unregister_family,
)

__all__ = [
    "Dims",
    "FamilySpec",
    "TensorMap",
    "families",
    "family",
    "family_for_architectures",
    "register_family",
    "supported_architectures",
    "unregister_family",
]
