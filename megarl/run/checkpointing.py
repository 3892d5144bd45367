"""Training checkpoints: models + optimizers (megatron dist checkpoints), schedulers, KL
controller, data position and RNG states, written atomically.

Layout: ``OUT/checkpoints/step_NNNNNNNN/{actor,critic,reward}/`` (megarl checkpoints, which
checkpoints_tools exports) and ``trainer/rank_R.pt``; ``OUT/checkpoints/latest`` names the newest
complete one. Everything is first written under ``step_NNNNNNNN.partial`` and renamed at the end,
so a crash mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.checkpoint import load_checkpoint, save_checkpoint
from megarl.checkpoint.store import model_sharded_state_dict, step_name, write_latest
from megarl.errors import CheckpointError


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
    # "dp_reshardable": each rank writes and reads its own optimizer shard, no gather; a resume
    # uses the same TP/PP anyway (per-rank RNG and data state).
    return trainable.optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
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
    """megatron 0.16's dp_reshardable load leaves torch Adam's per-parameter ``step`` wrong (it
    keeps the placeholder's); bias correction depends on it, so set it from our own record."""
    for inner, step in zip(_inner_optimizers(trainable), steps, strict=True):
        if step is None:
            continue
        for state in inner.state.values():
            if "step" in state:
                old = state["step"]
                state["step"] = torch.tensor(step, dtype=old.dtype, device=old.device)


def save(root: Path, step: int, roles, hf_dir: str, trainer_state: dict[str, Any]) -> Path:
    """Save everything for ``step``; collective over all ranks."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_name(step)
    stage = root / (final.name + ".partial")
    rank = dist.get_rank()
    if rank == 0 and stage.exists():
        shutil.rmtree(stage)
    dist.barrier()
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
    (stage / "trainer").mkdir(parents=True, exist_ok=True)
    state = dict(trainer_state)
    state["rng"] = _rng_state()
    state["schedulers"] = {n: t.scheduler.state_dict() for n, t in trainables.items()}
    state["adam_steps"] = {n: _adam_steps(t) for n, t in trainables.items()}
    torch.save(state, stage / "trainer" / f"rank_{rank}.pt")
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        stage.rename(final)
        write_latest(root, final.name)
    dist.barrier()
    return final


def latest(root: Path) -> Path | None:
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not path.is_dir():
        raise CheckpointError(
            f"{pointer} names {path.name}, which does not exist; delete {pointer} or restore the folder"
        )
    return path


def load(path: Path, roles) -> dict[str, Any]:
    """Restore models, optimizers, schedulers and RNG; returns this rank's trainer state."""
    for name, trainable in roles.trainables().items():
        if not (path / name).is_dir():
            raise CheckpointError(
                f"checkpoint {path} has no {name}; it was saved by a run with other settings"
            )
        loaded = load_checkpoint(
            path / name,
            trainable.ddp,
            dims=roles.dims,
            role=name,
            extra={"optimizer": _optimizer_state(trainable, is_loading=True)},
        )
        with torch.no_grad():  # it copies into views of the (leaf) parameters
            trainable.optimizer.load_state_dict(loaded["optimizer"])
    file = path / "trainer" / f"rank_{dist.get_rank()}.pt"
    if not file.is_file():
        raise CheckpointError(
            f"{file} is missing: the checkpoint was saved with a different number of processes; "
            "resume with the same world size"
        )
    state = torch.load(file, weights_only=False)
    for name, trainable in roles.trainables().items():
        trainable.scheduler.load_state_dict(state["schedulers"][name])
        _restore_adam_steps(trainable, state["adam_steps"][name])
    _set_rng_state(state["rng"])
    return state
