"""Checkpoint (2 of 3): the training loop's step checkpoints, written atomically.

A step checkpoint holds models + optimizers (model checkpoints in the format of
:mod:`megarl.checkpoint`, 1 of 3), schedulers, KL controller, data position and RNG
streams, loadable at any layout; ``checkpoints_tools`` (3 of 3) exports its models.

Layout: ``OUT/checkpoints/step_NNNNNNNN/{actor,critic,reward}/`` (megarl checkpoints, which
checkpoints_tools exports) and ``trainer/trainer_state.pt`` (plain data, written by rank 0, see
:mod:`megarl.run.trainer_state`); ``OUT/checkpoints/latest`` names the newest complete one.
Everything is first written under the hidden ``.step_NNNNNNNN.partial``, flushed to disk and
renamed at the end (:func:`megarl.checkpoint.atomic.publish`), so a crash or a failed write mid-save leaves the previous checkpoint as the latest and nothing
half-written under a visible name. Older checkpoints are then removed as ``trainer.keep_last`` /
``keep_every`` say (:mod:`megarl.run.retention`). Every file is listed with its size and checksum
in a manifest (each role folder's, and the step folder's for ``trainer/``), which a resume checks
before it loads anything (:mod:`megarl.run.verification`).

Models and optimizer states are megatron dist checkpoints in model space (the distributed
optimizer's ``fully_reshardable`` format): one global tensor per parameter and state,
whatever the TP x PP x DP layout, so they load at any other. Each data-parallel rank writes its
own part of the optimizer state without gathering the rest (:mod:`megarl.run.optimizer_shards`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import torch
import torch.distributed as dist

import megarl.checkpoint.manifest as manifest
from megarl import platform
from megarl.checkpoint import load_checkpoint, save_checkpoint
from megarl.checkpoint.atomic import publish
from megarl.checkpoint.safe_metadata import read_dist_metadata
from megarl.checkpoint.store import (
    MCORE_SUBDIR,
    checkpoint_dims,
    model_sharded_state_dict,
    read_meta,
    step_name,
    write_latest,
)
from megarl.config import TrainerConfig
from megarl.data.global_state import merge_rank_states
from megarl.errors import CheckpointError
from megarl.models.dims import ModelDims
from megarl.models.fused_adam import use_fused_adam
from megarl.models.lora import lora_record
from megarl.parallel import current_ranks
from megarl.run import faults, retention, verification, watchdog
from megarl.run import trainer_state as state_file
from megarl.run.optimizer_shards import sharded_optimizer_state

OPTIMIZER_FORMAT = "fully_reshardable"


def _coords() -> tuple[int, int, int]:

    r = current_ranks()
    return r["tp_rank"], r["pp_rank"], r["dp_rank"]


def _sizes() -> list[int]:

    r = current_ranks()
    return [r["tp_size"], r["pp_size"], r["dp_size"]]


def _rng_key(tp: int, pp: int, dp: int) -> str:
    return f"tp{tp}.pp{pp}.dp{dp}"


class RankRng(TypedDict):
    """One rank's random streams."""

    torch: torch.Tensor  # the default CPU generator
    tracker: dict[str, torch.Tensor]  # megatron's model-parallel RNG tracker streams
    cuda: NotRequired[torch.Tensor]


class SavedRng(TypedDict):
    """Every rank's streams, and the (tp, pp, dp) sizes of the layout that saved them."""

    layout: list[int]
    ranks: dict[str, RankRng]  # by _rng_key


def _rng_state() -> RankRng:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state: RankRng = {
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _gathered_rng() -> SavedRng:
    """Every rank's RNG streams, keyed by its (tp, pp, dp) coordinates."""
    mine = (_rng_key(*_coords()), _rng_state())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"layout": _sizes(), "ranks": dict(everyone)}


def _restore_rng(saved: SavedRng) -> None:
    """This rank's own streams when the layout is the same; otherwise the streams that exist in
    both layouts: the default generator of rank (0, 0, 0) and the tensor-parallel tracker stream
    of the same TP rank (a TP rank the old layout lacked keeps its fresh seeding)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tp, pp, dp = _coords()
    ranks = saved["ranks"]
    tracker: dict[str, torch.Tensor] | None
    if list(saved["layout"]) == _sizes():
        own = ranks[_rng_key(tp, pp, dp)]
        tracker = own["tracker"]
    else:
        own = ranks[_rng_key(0, 0, 0)]
        same_tp = ranks.get(_rng_key(tp, 0, 0))
        tracker = same_tp["tracker"] if same_tp is not None else None
    torch.set_rng_state(own["torch"])
    if tracker is not None:
        get_cuda_rng_tracker().set_states(tracker)
    if "cuda" in own and torch.cuda.is_available():
        torch.cuda.set_rng_state(own["cuda"])


def _optimizer_state(trainable, is_loading: bool):
    if is_loading:
        # A fresh distributed optimizer has no Adam state to load into yet; megatron fills it
        # with placeholders (one zero-grad step of the inner optimizer; the weights it touches
        # are overwritten by the checkpoint right after).
        for opt in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer]):
            if not opt.optimizer.state:
                with torch.no_grad():
                    opt._init_optimizer_states_with_dummy_values()
    model_sd = model_sharded_state_dict(trainable.model)
    if not is_loading:  # each rank its own blocks, no gather (megatron's save gathers)
        return sharded_optimizer_state(trainable.optimizer, model_sd)
    return trainable.optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": OPTIMIZER_FORMAT}
    )


def _inner_optimizers(trainable):
    return [
        opt.optimizer
        for opt in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer])
    ]


def _adam_steps(trainable) -> list[float | None]:
    """Adam's step count per inner optimizer (all parameters step together)."""
    out = []
    for inner in _inner_optimizers(trainable):
        steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
        out.append(steps.pop() if len(steps) == 1 else None)
    return out


def _restore_adam_steps(trainable, steps: list[float | None]) -> None:
    """megatron 0.16's load can leave torch Adam's per-parameter ``step`` at the placeholder's;
    bias correction depends on it, so set it from our own record."""
    for inner, step in zip(_inner_optimizers(trainable), steps, strict=True):
        if step is None:
            continue
        for state in inner.state.values():
            if "step" in state:
                old = state["step"]
                state["step"] = torch.tensor(step, dtype=old.dtype, device=old.device)


@torch.no_grad()  # it copies into views of the (leaf) parameters
def _load_optimizer(trainable, loaded: dict) -> None:
    """Load a ``fully_reshardable`` optimizer state into this rank's distributed optimizer.

    megatron 0.16 copies every per-parameter state key of torch Adam back from the checkpoint,
    "step" included, which that format does not store (KeyError 'step'): load the common part,
    then the parameter states with "step" set aside, then put it back (the count itself is
    restored from the trainer state by :func:`_restore_adam_steps`).
    """
    opts = getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer])
    parts = [loaded] if len(opts) == 1 else [v for _, v in sorted(loaded.items())]
    for opt, part in zip(opts, parts, strict=True):
        part = dict(part)
        param_state = part.pop("param_state")
        part.pop("param_state_sharding_type", None)
        opt.load_state_dict(part)
        inner = opt.optimizer.state
        steps = {p: s.pop("step") for p, s in inner.items() if "step" in s}
        opt.load_parameter_state_from_fully_reshardable(param_state)
        for p, step in steps.items():
            inner[p]["step"] = step
    use_fused_adam(trainable.optimizer)  # load_state_dict restored the groups' saved options


def _agree_on_failure(error: BaseException | None) -> str | None:
    """Every rank learns whether any rank failed (one all-reduce), so none waits for the others;
    on a failure, the first failing rank's message."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=platform.collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0.0:
        return None
    messages: list = [None] * dist.get_world_size()
    mine = f"{type(error).__name__}: {error}" if error is not None else None
    dist.all_gather_object(messages, mine)
    return next(m for m in messages if m is not None)


def save(
    root: Path,
    step: int,
    roles,
    hf_dir: str,
    state: dict[str, object],
    *,
    keep_last: int | None = None,
    keep_every: int = 0,
) -> Path:
    """Save everything for ``step``; collective over all ranks.

    ``state``: the loop's state (step, data position of this rank, ...), plain data.
    With ``keep_last``, older checkpoints are removed afterwards (see :mod:`retention`).
    """
    with watchdog.phase("save", step):
        return _save(root, step, roles, hf_dir, state, keep_last, keep_every)


def _save(root, step, roles, hf_dir, state_in, keep_last, keep_every) -> Path:
    final = root / step_name(step)
    stage = root / f".{final.name}.partial"
    rank = dist.get_rank()
    error: BaseException | None = None
    try:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            retention.remove_stale_partials(root)
    except OSError as e:
        error = e
    failed = _agree_on_failure(error)
    if failed is not None:
        raise CheckpointError(
            f"cannot create the checkpoint folder {root} ({failed}); fix its permissions or "
            "choose another trainer.output_dir"
        )
    trainables = roles.trainables()
    for name, trainable in trainables.items():
        save_checkpoint(
            stage / name,
            trainable.ddp,
            role=name,
            hf_assets=hf_dir,
            step=step,
            extra={"optimizer": _optimizer_state(trainable, is_loading=False)},
        )
    try:
        faults.inject("save", step)  # test-only: a failure or a kill in the middle of the save
    except OSError as e:
        error = e
    _raise_if_failed(_agree_on_failure(error), root, stage, step)
    data_reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(data_reports, state_in.get("data"))
    rng = _gathered_rng()
    try:
        if rank == 0:
            state = dict(state_in)
            if state.get("data") is not None:
                state["data"] = merge_rank_states(data_reports)
            state["roles"] = sorted(trainables)
            state["rng"] = rng
            state["schedulers"] = {n: t.scheduler.state_dict() for n, t in trainables.items()}
            state["adam_steps"] = {n: _adam_steps(t) for n, t in trainables.items()}
            (stage / "trainer").mkdir(parents=True, exist_ok=True)
            written = state_file.write(stage / "trainer", state)
            # the step's own manifest: what is not in a role folder (those carry theirs)
            manifest.write(stage, [manifest.record(stage, written.relative_to(stage).as_posix())])
            publish(stage, final)  # the same step saved again: the old folder goes aside first
            write_latest(root, final.name)
    except (OSError, TypeError) as e:
        error = e
    _raise_if_failed(_agree_on_failure(error), root, stage, step)
    if rank == 0 and keep_last is not None:
        retention.prune(root, keep_last=keep_last, keep_every=keep_every)
    dist.barrier()
    return final


def _raise_if_failed(failed: str | None, root: Path, stage: Path, step: int) -> None:
    if failed is None:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(stage, ignore_errors=True)
    raise CheckpointError(
        f"saving the checkpoint of step {step} into {root} failed ({failed}); nothing of it was "
        f"kept and `latest` still names the previous checkpoint. Free space or fix the "
        f"permissions of {root}, then run again to resume"
    )


def check_resume(path: Path, roles: list[str], model_paths: dict[str, str]) -> dict[str, Any]:
    """Cheap checks before any model is built: the trainer state is plain data, the checkpoint
    trains the same roles (e.g. a critic, or none) and holds the same model. Returns the state."""

    state = state_file.read(path)
    saved = sorted(state.get("roles", []))
    if saved != sorted(roles):
        raise CheckpointError(
            f"checkpoint {path} trains {saved}, this run trains {sorted(roles)}: it was saved by "
            f"a run with another algorithm (e.g. a critic for GAE, none for GRPO). {ANOTHER_RUN}"
        )
    for role, model_path in model_paths.items():
        want, have = ModelDims.from_pretrained(model_path), checkpoint_dims(path / role)
        if have.shape != want.shape or have.hidden_size != want.hidden_size:
            raise CheckpointError(
                f"checkpoint {path} holds another {role} model ({have.architecture}, hidden "
                f"{have.hidden_size}, {have.shape}) than {model_path} ({want.architecture}, hidden "
                f"{want.hidden_size}, {want.shape}). {ANOTHER_RUN}"
            )
        read_dist_metadata(path / role / MCORE_SUBDIR)  # refuses metadata that would run code
    return state


# The ways on when trainer.output_dir holds checkpoints of another run.
ANOTHER_RUN = (
    "Resume with the settings it was saved with, set trainer.overwrite=true to move that run "
    "aside (nothing is deleted) and start afresh, or use another trainer.output_dir"
)


def resume_point(trainer: TrainerConfig, model_paths: dict[str, str]) -> Path | None:
    """The checkpoint a run resumes from (``trainer.resume=auto``: the newest intact one, see
    :mod:`megarl.run.verification`), after the cheap checks of :func:`check_resume` against the
    roles the run trains (role -> its HF folder); None to start afresh. Collective."""
    if trainer.resume != "auto":
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = verification.newest_intact(Path(trainer.output_dir) / "checkpoints", rank)
    if path is None:
        return None
    check_resume(path, sorted(model_paths), model_paths)
    return path


def _check_same_lora(ckpt: Path, model) -> None:
    """A LoRA checkpoint resumes only into the same adapters, a full one only without them."""

    saved, wanted = read_meta(ckpt).lora, lora_record(model)
    if saved != wanted:
        raise CheckpointError(
            f"checkpoint {ckpt} holds LoRA adapters {saved or 'none'}, this run's actor "
            f"{wanted or 'none'} (actor.lora). {ANOTHER_RUN}"
        )


def load(path: Path, roles) -> dict[str, Any]:
    """Restore models, optimizers, schedulers and RNG at this run's layout (any layout); returns
    the trainer state, with ``data`` the global data position (datasets pick their part)."""
    state = state_file.read(path)
    for name, trainable in roles.trainables().items():
        if not (path / name).is_dir():
            raise CheckpointError(
                f"checkpoint {path} has no {name}; it was saved by a run with other settings"
            )
        _check_same_lora(path / name, trainable.model)
        loaded = load_checkpoint(
            path / name,
            trainable.ddp,
            dims=roles.dims,
            role=name,
            extra={"optimizer": _optimizer_state(trainable, is_loading=True)},
        )
        _load_optimizer(trainable, loaded["optimizer"])
    for name, trainable in roles.trainables().items():
        trainable.scheduler.load_state_dict(state["schedulers"][name])
        _restore_adam_steps(trainable, state["adam_steps"][name])
    _restore_rng(state["rng"])
    return state
