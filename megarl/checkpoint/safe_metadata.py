"""Reading a dist checkpoint's ``.metadata`` without running code from it.

torch.distributed.checkpoint writes ``.metadata`` with ``pickle`` and reads it back with
``pickle.load``, which calls whatever a crafted file names (``os.system`` ...). This module
unpickles it through an allow-list instead: the metadata classes of torch.distributed.checkpoint
(dataclasses and enums, which rebuild plain fields), ``torch.Size``, torch's dtypes, layouts and
memory formats, ``pathlib`` paths, and nothing else; anything else is refused naming the file.
Every storage path it lists must be a file name inside the checkpoint (megarl.checkpoint.contained):
an absolute or ``..`` path would make a load read bytes from elsewhere. A checkpoint that
declares pickled objects (``BytesStorageMetadata``: loading them runs ``torch.load`` without
``weights_only``) is refused too: megarl's checkpoints hold tensors only. The one exception is
Transformer Engine's ``_extra_state``, which megarl never loads (see ``IGNORED_OBJECTS``).
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megarl.checkpoint.contained import check_entry, refuse_links
from megarl.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

DIST_METADATA = ".metadata"

# module -> names a dist checkpoint's metadata may reference (what torch 2.13 writes for
# megatron-core 0.16's torch_dist format, and the classes of the same modules it may add).
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "ChunkStorageMetadata",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.planner": frozenset(
        {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem"}
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # looks a layout up by its name
    "collections": frozenset({"OrderedDict"}),
    # torch's own writer records the checkpoint's path (StorageMeta.checkpoint_id) as given
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
# Objects a checkpoint may declare because megarl never loads them, so their bytes are never
# unpickled: Transformer Engine's FP8 metadata (`_extra_state`), which a TE-spec model written by
# megatron carries and megarl's loads leave out (checkpoint.store.model_sharded_state_dict).
IGNORED_OBJECTS = ("_extra_state",)


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names something outside the allow-list."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if module == "torch":
            if name == "Size":
                return torch.Size
            value = getattr(torch, name, None)
            if isinstance(value, _TORCH_VALUES):
                return value
        elif name in _ALLOWED.get(module, ()):
            return getattr(importlib.import_module(module), name)
        raise RefusedGlobal(f"{module}.{name}")


def refused_pickle(what: str, error: BaseException) -> CheckpointError:
    """The one message for a pickle that ``weights_only`` loading refused: it names more than
    plain data, which could run code when unpickled. ``error``'s own text is many lines; its
    first says which operand or global was refused."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return CheckpointError(
        f"{what} holds more than plain data (tensors, numbers, strings): loading it could run "
        f"code, so megarl refuses it ({first}). Use checkpoints you trust"
    )


def read_dist_metadata(path: str | Path) -> Metadata:
    """The ``Metadata`` of a dist checkpoint, from its ``.metadata`` file (or the folder)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    path = Path(path)
    if path.is_dir():
        path = path / DIST_METADATA
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except RefusedGlobal as e:
        raise CheckpointError(
            f"{path} is not plain checkpoint metadata: it names {e}, which unpickling would "
            "import or call (a pickle can run any code this way), so megarl refuses to read it. "
            "Use checkpoints written by megarl (or megatron-core) that you trust"
        ) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
    except Exception as e:  # truncated or garbled bytes: EOFError, UnpicklingError, ValueError ...
        raise CheckpointError(
            f"cannot read {path} ({type(e).__name__}: {e}); the checkpoint is damaged"
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointError(
            f"{path} holds a {type(md).__name__}, not dist-checkpoint metadata; the checkpoint "
            "is damaged"
        )
    for index, info in (getattr(md, "storage_data", None) or {}).items():
        rel = getattr(info, "relative_path", None)  # where a chunk's bytes are: inside, by name
        check_entry(str(rel), f"{path} (the storage of {getattr(index, 'fqn', index)!r})")
    objects = sorted(
        k
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, BytesStorageMetadata)
        and not k.split("/", 1)[0].endswith(IGNORED_OBJECTS)  # "<key>/shard_<i>" too
    )
    if objects:
        raise CheckpointError(
            f"{path} declares pickled objects ({', '.join(objects[:3])}), which loading would "
            "unpickle without restriction; megarl checkpoints hold tensors only, so it refuses "
            "this one"
        )
    return md


def safe_filesystem_reader(checkpoint_dir: str | Path):
    """A torch ``FileSystemReader`` of ``checkpoint_dir`` whose metadata comes through
    :func:`read_dist_metadata` (read once, then cached: megatron asks for it twice)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        _metadata = None

        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # per-rank metadata files: not written by megarl
                raise CheckpointError(f"{checkpoint_dir}: per-rank metadata is not supported")
            if self._metadata is None:
                refuse_links(Path(checkpoint_dir))  # its data files are read by name
                md = read_dist_metadata(Path(checkpoint_dir))
                if getattr(md, "storage_meta", None) is None:
                    md.storage_meta = StorageMeta()
                md.storage_meta.load_id = self.load_id
                self._metadata = md
            return self._metadata

    return SafeFileSystemReader(checkpoint_dir)
