"""Megatron distributed checkpoints of megarl models: folder layout, metadata, atomic save, load.

A checkpoint is a folder::

    CKPT/
      megarl_checkpoint.json   what it holds (role, dtype, the layout it was saved at); a folder
                               without it is not a (complete) checkpoint
      manifest.json            every other file's size and checksum (megarl.checkpoint.manifest),
                               written last
      hf/                      config.json, generation_config.json and tokenizer files of the model
      mcore/                   a megatron-core ``dist_checkpointing`` checkpoint (torch_dist):
                               global tensors, loadable at any TP/PP

A training run keeps ``ROOT/step_00000100/`` folders and a ``ROOT/latest`` file naming the newest;
every function taking a checkpoint path also accepts such a root.

Saving is atomic: every rank writes into a hidden ``.NAME.partial-*`` sibling folder, which rank 0
flushes to disk and renames to ``NAME`` once the whole checkpoint is written
(:func:`megarl.checkpoint.atomic.publish`). A crash leaves only the hidden folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

import megarl.checkpoint.manifest as manifest
from megarl.checkpoint.atomic import publish
from megarl.checkpoint.contained import inside, read_pointer, refuse_links
from megarl.checkpoint.hf_assets import copy_hf_assets, dims_from_config, read_json
from megarl.checkpoint.safe_load import load_failure, safe_strategies
from megarl.checkpoint.write_hashing import SIDECAR, hashed_writes, take_sidecar
from megarl.dtypes import dtype_from_name, dtype_name
from megarl.errors import CheckpointError, ConfigError
from megarl.files import replace_file
from megarl.models.build import ModelOptions, build_gpt_model
from megarl.models.dims import ModelDims
from megarl.models.heads import has_scalar_head
from megarl.models.loading import unwrap
from megarl.models.lora import lora_record
from megarl.parallel import current_ranks

META_FILE = "megarl_checkpoint.json"
HF_SUBDIR = "hf"
MCORE_SUBDIR = "mcore"
LATEST_FILE = "latest"
FORMAT = "megarl-mcore-checkpoint"
FORMAT_VERSION = 1
ROLES = ("actor", "critic", "reference", "reward")


@dataclass(frozen=True)
class CheckpointMeta:
    """Contents of ``megarl_checkpoint.json``."""

    role: str
    architecture: str
    dtype: str
    saved_layout: dict[str, int]
    step: int | None = None
    source: str | None = None
    megatron_core: str = ""
    # LoRA adapters in the checkpoint: rank, alpha, dropout, target_modules (None: none)
    lora: dict[str, Any] | None = None
    created_unix: float = field(default_factory=time.time)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_file(cls, path: Path) -> CheckpointMeta:
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(
                f"{path} is not valid JSON ({e}); the checkpoint is damaged"
            ) from e
        if raw.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a megarl checkpoint description")
        if int(raw.get("format_version", 0)) > FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has format version {raw['format_version']}, newer than this megarl "
                f"understands ({FORMAT_VERSION}); upgrade megarl"
            )
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})


def megatron_core_version() -> str:
    try:
        return version("megatron-core")
    except Exception:
        return ""


# ---------------------------------------------------------------------------------------------
# Finding a checkpoint


# A training step folder holds one checkpoint per trained role; asked for "the" checkpoint of a
# step, the first of these present is the one meant (the policy, or the reward model of train-rm).
ROLE_PREFERENCE = ("actor", "reward", "critic", "reference")


def step_roles(folder: Path) -> list[str]:
    """The roles a training step folder holds checkpoints for, in :data:`ROLE_PREFERENCE` order."""
    return [r for r in ROLE_PREFERENCE if (folder / r / META_FILE).is_file()]


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names: itself; the one its ``latest`` file points to (a
    training run's ``checkpoints/`` folder); or, for a training step folder (``step_N/`` with one
    checkpoint per role), its actor's (else its reward model's, critic's, reference's).

    Raises :class:`CheckpointError` with what is wrong for missing, partial or foreign folders,
    and for a checkpoint that holds a symbolic link or whose ``latest`` leaves its folder
    (megarl.checkpoint.contained): nothing outside the checkpoint is ever read through it.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint folder {path} does not exist; pass the folder written by "
            "`megarl convert hf-to-mcore` or by training (a run's checkpoints/ folder, one of its "
            "step_N folders, or a role folder inside one)"
        )
    if (path / META_FILE).is_file():
        refuse_links(path)
        return path
    roles = step_roles(path)
    if roles:
        inside(path, roles[0], f"training step {path}")
        return resolve_checkpoint(path / roles[0])
    name = read_pointer(path, LATEST_FILE)
    if name is not None:
        latest = path / LATEST_FILE
        target = path / name
        if not (target / META_FILE).is_file() and not step_roles(target):
            raise CheckpointError(
                f"{latest} points to {name!r}, but {target} is missing or incomplete; "
                f"pass one of the complete checkpoints in {path}: {list_checkpoints(path) or 'none'}"
            )
        return resolve_checkpoint(target)
    if (path / MCORE_SUBDIR).is_dir() or (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path} is an incomplete checkpoint: {META_FILE} is missing (the save did not "
            "finish, or it is a bare megatron checkpoint without megarl's metadata); "
            "save or convert it again"
        )
    steps = list_checkpoints(path)
    hint = f"; checkpoints inside it: {steps}" if steps else ""
    raise CheckpointError(
        f"{path} is not a megarl checkpoint (no {META_FILE}, no role folders and no "
        f"`{LATEST_FILE}` file){hint}"
    )


def list_checkpoints(root: str | Path) -> list[str]:
    """The complete checkpoints in ``root``: role checkpoints and training step folders."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / META_FILE).is_file() or step_roles(p))


def read_meta(path: str | Path) -> CheckpointMeta:
    return CheckpointMeta.from_file(resolve_checkpoint(path) / META_FILE)


def checkpoint_dims(ckpt: str | Path) -> ModelDims:
    """The model shape of the Hugging Face config stored in checkpoint ``ckpt``."""

    return dims_from_config(read_json(resolve_checkpoint(ckpt) / HF_SUBDIR / "config.json"))


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def write_latest(root: str | Path, name: str) -> None:
    """Point ``root/latest`` at ``name`` (atomically: a fresh temporary file, then rename)."""
    replace_file(Path(root) / LATEST_FILE, name + "\n")


# ---------------------------------------------------------------------------------------------
# Atomic output folders (used for checkpoints and for Hugging Face exports)


def _looks_replaceable(path: Path) -> bool:
    """Only folders megarl could have written are ever deleted by ``--overwrite``."""
    if not any(path.iterdir()):
        return True
    return any((path / n).exists() for n in (META_FILE, LATEST_FILE, "config.json"))


def check_destination(final: str | Path, overwrite: bool) -> Path:
    """Refuse an output folder that exists (unless ``overwrite``) or that we may not replace."""
    final = Path(final).absolute()
    if final.exists():
        if not final.is_dir():
            raise CheckpointError(f"output {final} exists and is not a folder; choose another path")
        if not overwrite:
            raise CheckpointError(
                f"output folder {final} already exists; pass --overwrite to replace it "
                "or choose another output folder"
            )
        if not _looks_replaceable(final):
            raise CheckpointError(
                f"refusing to overwrite {final}: it is neither a megarl checkpoint nor a Hugging "
                "Face model folder; choose another output folder"
            )
    return final


def check_not_inside(out: str | Path, source: str | Path, what: str) -> None:
    """Refuse an output folder that is, contains or sits inside the input (``--overwrite``
    would delete the input)."""
    out, source = Path(out).resolve(), Path(source).resolve()
    if out == source or out in source.parents or source in out.parents:
        raise ConfigError(
            f"output {out} overlaps the {what} {source}; write the output to a separate folder"
        )


def _dist_active() -> bool:

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_rank0() -> bool:

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _barrier() -> None:
    if _dist_active():
        dist.barrier()


def _commit(tmp: Path, final: Path, overwrite: bool) -> None:
    if final.exists():
        check_destination(final, overwrite)
    publish(tmp, final)


@contextmanager
def staged_output(final: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a hidden temporary folder beside ``final``; rename it to ``final`` on success.

    Collective when torch.distributed is initialised (every rank gets the same folder). On an
    exception the temporary folder is removed; a killed process leaves only the hidden folder,
    never something at ``final``.
    """
    final = Path(final).absolute()
    box: list[str | None] = [None, None]  # (temporary folder, error message) decided by rank 0
    if _is_rank0():
        try:
            check_destination(final, overwrite)
            final.parent.mkdir(parents=True, exist_ok=True)
            box[0] = made = tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(made, 0o777 & ~umask)  # mkdtemp makes it private; the result should not be
        except (CheckpointError, OSError) as e:
            box[1] = str(e) if isinstance(e, CheckpointError) else f"cannot create {final}: {e}"
    if _dist_active():
        dist.broadcast_object_list(box, src=0)
    folder, error = box
    if error is not None:
        raise CheckpointError(error)  # on every rank, so none waits for the others
    assert folder is not None  # rank 0 made it, or said why not
    tmp = Path(folder)
    try:
        yield tmp
        _barrier()
        if _is_rank0():
            _commit(tmp, final, overwrite)
        _barrier()
    except BaseException:
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------
# Save and load (collective: every rank of the model's layout calls them)


@contextmanager
def _quiet_dist_checkpointing() -> Iterator[None]:
    """megatron-core 0.16 drives torch's ShardedTensor-based checkpoint API, which warns on
    every call that it is deprecated; nothing to act on here."""
    with warnings.catch_warnings():
        for message in (
            ".*we are deprecating ShardedTensor.*",
            ".*`load_state_dict` is deprecated.*",
            ".*`save_state_dict` is deprecated.*",
        ):
            warnings.filterwarnings("ignore", message=message, category=FutureWarning)
        yield


def _unwrap(model):

    return unwrap(model)


def model_sharded_state_dict(model) -> dict[str, object]:
    """megatron's sharded state of ``model``, the same whichever layer spec built it.

    Tensor keys already agree between the local and the Transformer Engine spec (megatron saves
    the local spec's norm weights under TE's names, see :mod:`megarl.checkpoint.keys`). TE modules
    add ``_extra_state`` objects (FP8 scaling metadata megarl never uses) that a local-spec model
    neither writes nor reads: they are left out of every save and load, so a checkpoint written
    on a CPU box (local spec) loads on a GPU box (TE spec) and back.
    """
    sharded = _unwrap(model).sharded_state_dict()
    return {k: v for k, v in sharded.items() if not k.endswith("_extra_state")}


def _layout_dict() -> dict[str, int]:

    r = current_ranks()
    return {"tp": r["tp_size"], "pp": r["pp_size"], "dp": r["dp_size"]}


def save_checkpoint(
    path: str | Path,
    model,
    *,
    role: str,
    hf_assets: str | Path,
    overwrite: bool = False,
    step: int | None = None,
    source: str | None = None,
    extra: dict[str, object] | None = None,
) -> Path:
    """Save ``model`` (this rank's shard) as a megarl checkpoint at ``path``; collective.

    ``hf_assets``: a folder with the model's config.json and tokenizer files (the HF folder the
    model came from, or the ``hf/`` folder of the checkpoint it was loaded from).
    ``extra``: more sharded state (e.g. ``{"optimizer": optimizer.sharded_state_dict(...)}``),
    saved in the same dist checkpoint under its own keys.
    """
    from megatron.core import dist_checkpointing

    from megarl.checkpoint.write_results import in_process_write_results

    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}; choose one of {ROLES}")
    gpt = _unwrap(model)
    state = {"model": model_sharded_state_dict(gpt), **(extra or {})}
    dtype = next(gpt.parameters()).dtype
    with staged_output(path, overwrite=overwrite) as tmp:
        mcore = tmp / MCORE_SUBDIR
        if _is_rank0():
            mcore.mkdir()
            copy_hf_assets(hf_assets, tmp / HF_SUBDIR)
        _barrier()
        in_process_write_results()
        with _quiet_dist_checkpointing(), hashed_writes():
            dist_checkpointing.save(state, str(mcore))
        _barrier()
        records = written_records(tmp)  # collective: each rank hashes the files it wrote
        if _is_rank0():
            cfg = read_json(tmp / HF_SUBDIR / "config.json")
            meta = CheckpointMeta(
                role=role,
                architecture=(cfg.get("architectures") or ["?"])[0],
                dtype=dtype_name(dtype),
                saved_layout=_layout_dict(),
                step=step,
                source=source,
                megatron_core=megatron_core_version(),
                lora=lora_record(gpt),
            )
            (tmp / META_FILE).write_text(meta.to_json())
            manifest.write(tmp, [*records, manifest.record(tmp, META_FILE)])
    return Path(path).absolute()


def written_records(folder: Path) -> list[manifest.FileRecord]:
    """Size and checksum of every file below ``folder`` (a checkpoint just written); collective.

    Each rank takes the digests of the dist-checkpoint files it wrote (``mcore/__R_*.distcp``)
    from what the writer hashed as it wrote them (:mod:`megarl.checkpoint.write_hashing`; a file
    without one is read back), rank 0 hashes everything else; rank 0 gets them all, the other
    ranks an empty list.
    """

    rank, world = (dist.get_rank(), dist.get_world_size()) if _dist_active() else (0, 1)
    if rank == 0:
        names = [
            n
            for n in manifest.files_under(folder)
            if manifest.writer_rank(n, world) == 0 and not n.endswith(SIDECAR)
        ]
    else:
        names = sorted(
            f"{MCORE_SUBDIR}/{p.name}" for p in (folder / MCORE_SUBDIR).glob(f"__{rank}_*.distcp")
        )
    mine = []
    for name in names:
        digest = take_sidecar(folder / name) if name.endswith(".distcp") else None
        if digest is None:
            mine.append(manifest.record(folder, name))
        else:
            mine.append(manifest.FileRecord(name, (folder / name).stat().st_size, digest))
    if world == 1:
        return mine
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return [r for part in everyone for r in part] if rank == 0 else []


def save_step(
    root: str | Path, step: int, model, *, role: str, hf_assets: str | Path, **kwargs: Any
) -> Path:
    """Save ``root/step_NNNNNNNN`` and point ``root/latest`` at it (training checkpoints)."""
    path = save_checkpoint(
        Path(root) / step_name(step), model, role=role, hf_assets=hf_assets, step=step, **kwargs
    )
    if _is_rank0():
        write_latest(root, path.name)
    _barrier()
    return path


def check_compatible(ckpt: Path, dims: ModelDims, role: str) -> CheckpointMeta:
    """The checkpoint's metadata, after checking it fits a model of ``dims`` and ``role``."""
    meta = read_meta(ckpt)
    saved = checkpoint_dims(ckpt)
    if saved.shape != dims.shape or saved.hidden_size != dims.hidden_size:
        raise CheckpointError(
            f"checkpoint {ckpt} holds a different model ({saved.architecture}, hidden "
            f"{saved.hidden_size}, {saved.shape}) than the one being loaded ({dims.architecture}, "
            f"hidden {dims.hidden_size}, {dims.shape}); point to the checkpoint of this model"
        )
    if has_scalar_head(meta.role) and role != meta.role:
        raise CheckpointError(
            f"checkpoint {ckpt} is a {meta.role} (scalar head); it cannot load into an {role} "
            f"model. Use an actor checkpoint, or load it as the {meta.role}"
        )
    return meta


@torch.no_grad()
def load_checkpoint(
    path: str | Path,
    model,
    *,
    dims: ModelDims,
    role: str,
    extra: dict[str, object] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (this rank's shard, at any layout); collective.

    A critic or reward model may start from an actor checkpoint: its trunk is loaded and its
    scalar head is left as it is. Returns the loaded ``extra`` state (keys of ``extra``).
    """
    from megatron.core import dist_checkpointing

    ckpt = resolve_checkpoint(path)
    meta = check_compatible(ckpt, dims, role)
    gpt = _unwrap(model)
    model_sd = model_sharded_state_dict(gpt)
    trunk_only = has_scalar_head(role) and meta.role != role
    if trunk_only:
        model_sd = {k: v for k, v in model_sd.items() if not k.startswith("output_layer.")}
    try:
        with _quiet_dist_checkpointing():
            loaded = dist_checkpointing.load(
                {"model": model_sd, **(extra or {})},
                str(ckpt / MCORE_SUBDIR),
                **safe_strategies(),  # nothing in the checkpoint is unpickled unrestricted
            )
    except CheckpointError:
        raise
    # megatron raises CheckpointingException, KeyError, RuntimeError...; torch's distributed
    # checkpoint a CheckpointException, which is a BaseException
    except (Exception, CheckpointException) as e:
        raise load_failure(ckpt, e) from None
    missing, unexpected = gpt.load_state_dict(loaded.pop("model"), strict=False)
    missing = [
        k
        for k in missing
        if not k.endswith("_extra_state") and not (trunk_only and k.startswith("output_layer."))
    ]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {ckpt} does not match the model: missing {missing}, unexpected {unexpected}"
        )
    return loaded


def build_model_from_checkpoint(path: str | Path, layout, role: str | None = None, opts=None):
    """Build this rank's model shard at ``layout`` and load the checkpoint; collective.

    Returns ``(model, dims, meta)``. ``role`` defaults to the checkpoint's own.
    """

    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    dims = checkpoint_dims(ckpt)
    role = role or meta.role
    layout.check_model(dims.shape)
    opts = opts or ModelOptions(dtype=dtype_from_name(meta.dtype))
    model = build_gpt_model(dims, layout, role, opts)
    load_checkpoint(ckpt, model, dims=dims, role=role)
    return model, dims, meta
