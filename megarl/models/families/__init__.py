"""The model families: one module per architecture family (see :mod:`megarl.models.families.base`).

Importing this package registers the built-in families; a new dense family is one module here
(build a :class:`ModelFamily`, ``register_family`` it) plus its import below.
"""

from megarl.models.families import (  # noqa: F401  (registers the families)
    llama,
    mixtral,
    qwen2,
    qwen3,
    qwen3_moe,
)
from megarl.models.families.base import (
    Dims,
    ModelFamily,
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
    "ModelFamily",
    "TensorMap",
    "families",
    "family",
    "family_for_architectures",
    "register_family",
    "supported_architectures",
    "unregister_family",
]
