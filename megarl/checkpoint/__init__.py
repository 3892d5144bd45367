"""Checkpoint (1 of 3): the on-disk format of one model, a megatron dist checkpoint.

Save, load at any TP/PP, stream-read. The word has one meaning in three places: this
package (one model's checkpoint format), :mod:`megarl.run.checkpointing` (the loop's step
checkpoints: one such model checkpoint per role plus the trainer state) and
``checkpoints_tools`` (the CLIs converting model checkpoints to and from Hugging Face).

See :mod:`megarl.checkpoint.store` for the folder layout; ``checkpoints_tools`` converts these
checkpoints to and from Hugging Face.
"""

from megarl.checkpoint.keys import dist_checkpoint_key
from megarl.checkpoint.reader import DistCheckpointReader
from megarl.checkpoint.store import (
    HF_SUBDIR,
    LATEST_FILE,
    MCORE_SUBDIR,
    META_FILE,
    CheckpointMeta,
    build_model_from_checkpoint,
    check_destination,
    checkpoint_dims,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    resolve_checkpoint,
    save_checkpoint,
    save_step,
    staged_output,
    write_latest,
)

__all__ = [
    "HF_SUBDIR",
    "LATEST_FILE",
    "MCORE_SUBDIR",
    "META_FILE",
    "CheckpointMeta",
    "DistCheckpointReader",
    "build_model_from_checkpoint",
    "check_destination",
    "checkpoint_dims",
    "dist_checkpoint_key",
    "list_checkpoints",
    "load_checkpoint",
    "read_meta",
    "resolve_checkpoint",
    "save_checkpoint",
    "save_step",
    "staged_output",
    "write_latest",
]
