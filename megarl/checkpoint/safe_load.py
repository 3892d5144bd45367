"""The load strategies megarl hands to megatron's ``dist_checkpointing.load``: nothing a checkpoint
holds is run while it loads.

megatron-core 0.16's ``torch_dist`` strategy reads ``.metadata`` through torch's
``FileSystemReader`` (plain ``pickle.load``) and ``common.pt`` with ``torch.load`` at torch's
default. Here the sharded strategy reads through :func:`safe_filesystem_reader` (the allow-listed
unpickler of :mod:`megarl.checkpoint.safe_metadata`) and the common strategy loads ``common.pt``
with ``weights_only=True``. megatron builds its reader in one module function,
``strategies.torch._get_filesystem_reader``; the strategy below replaces that function for the
duration of its own calls only (``tests/unit/test_checkpoint_safety.py`` pins the call site, so an
upgrade that moves it fails there).
"""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from megarl.checkpoint.safe_metadata import refused_pickle, safe_filesystem_reader
from megarl.errors import CheckpointError

COMMON_FILE = "common.pt"


def load_common(checkpoint_dir: str | Path) -> dict:
    """``common.pt`` of a dist checkpoint, plain data only (``weights_only=True``)."""
    path = Path(checkpoint_dir) / COMMON_FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
    except pickle.UnpicklingError as e:
        raise refused_pickle(str(path), e) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(
            f"cannot read {path} ({type(e).__name__}: {e}); the checkpoint is damaged"
        ) from None


@contextmanager
def _safe_readers() -> Iterator[None]:
    import megatron.core.dist_checkpointing.strategies.torch as mcore_torch

    original = mcore_torch._get_filesystem_reader
    mcore_torch._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: (
        safe_filesystem_reader(checkpoint_dir)
    )
    try:
        yield
    finally:
        mcore_torch._get_filesystem_reader = original


@functools.cache
def _strategy_classes() -> tuple[type, type]:
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    class SafeTorchDistLoad(TorchDistLoadShardedStrategy):
        """megatron's torch_dist load, reading metadata through the allow-listed unpickler."""

        def load(self, sharded_state_dict, checkpoint_dir):
            with _safe_readers():
                return super().load(sharded_state_dict, checkpoint_dir)

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            with _safe_readers():
                return super().load_tensors_metadata(checkpoint_dir, metadata)

        def load_sharded_metadata(self, checkpoint_dir):
            with _safe_readers():
                return super().load_sharded_metadata(checkpoint_dir)

    class SafeCommonLoad(TorchCommonLoadStrategy):
        """``common.pt`` with ``weights_only=True``; no pickled object files."""

        def load_common(self, checkpoint_dir):
            return load_common(checkpoint_dir)

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise CheckpointError(
                f"{os.fspath(checkpoint_dir)} asks to load pickled objects; megarl checkpoints "
                "hold tensors only, so it refuses them"
            )

    return SafeTorchDistLoad, SafeCommonLoad


def safe_strategies() -> dict[str, object]:
    """``sharded_strategy`` and ``common_strategy`` keyword arguments of megatron's load."""
    sharded, common = _strategy_classes()
    return {"sharded_strategy": sharded(), "common_strategy": common()}


def load_failure(checkpoint: Path, error: BaseException) -> CheckpointError:
    """One :class:`CheckpointError` for a load that failed, whatever raised it.

    torch's distributed checkpoint runs each rank's reads inside its own collectives and raises a
    ``CheckpointException`` (a ``BaseException``, past any ``except Exception``) whose text is
    every failing rank's traceback. Inside it: megarl's own refusal (a shard holding more than
    plain data, a link leaving the folder), kept as it is, or a library error, said in one line.
    """
    failures = getattr(error, "failures", None)
    causes = [exc for exc, _ in failures.values()] if isinstance(failures, dict) else []
    causes = [c for c in causes if isinstance(c, BaseException)] or [error]
    for cause in causes:
        if isinstance(cause, CheckpointError):
            return cause
    first = causes[0]
    line = (str(first).strip().splitlines() or [""])[0]
    if isinstance(first, pickle.UnpicklingError):
        return refused_pickle(f"a shard of {checkpoint}", first)
    return CheckpointError(
        f"cannot load checkpoint {checkpoint}: {type(first).__name__}: {line}. The checkpoint is "
        "partial or damaged; save or convert it again"
    )
