"""What the fork server of :func:`tests.mp.run_gloo` imports once, so that its workers start
with it imported: the libraries every distributed worker loads (torch, megatron-core with
megarl's lean imports, transformers' models). Importing starts no thread that a fork would
lose half-way (checked by tests/unit/test_mp_preload.py), and no library computes anything here.
"""

from __future__ import annotations

from megarl.lean_imports import import_megatron_lean, import_transformers_lean

import_transformers_lean()
import_megatron_lean()

import megatron.core.distributed  # noqa: E402
import megatron.core.models.gpt  # noqa: E402
import megatron.core.optimizer  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import transformers.modeling_utils  # noqa: E402
import transformers.models.auto.modeling_auto  # noqa: E402
import transformers.models.auto.tokenization_auto  # noqa: E402,F401

import megarl.models  # noqa: E402,F401
