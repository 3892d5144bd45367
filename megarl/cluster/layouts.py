"""Which layout a job takes at a given world size, for elastic restarts and their checks.

Pure: a run config, the model's dimensions and a world size in, a :class:`ParallelLayout` out.
The order of preference is the run's own TP x PP (and rollout TP, expert parallel size, uneven
pipeline split) with DP filling the world; else the layout closest to it (TP first, then PP)
that the model, the batch sizes and - on GPUs - the planner's memory check accept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial

from megarl.config import ParallelConfig, RunConfig, validate
from megarl.errors import ConfigError, MegarlError
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.plan.hardware import divisors
from megarl.plan.search import uneven_split

# A check beyond the model's shape and the batch split: None when the layout fits, else why not
# (on GPUs: the planner's memory estimate against the device's memory).
FitCheck = Callable[[RunConfig, ParallelLayout], str | None]

# Whether the run can take a layout: None when it can, else why not (:func:`why_not` of the run's
# config, bound with functools.partial).
LayoutCheck = Callable[[ParallelLayout], str | None]


def at_layout(cfg: RunConfig, layout: ParallelLayout) -> RunConfig:
    """``cfg`` with its parallel section set to ``layout``."""
    parallel = replace(
        cfg.parallel,
        tp=layout.tp,
        pp=layout.pp,
        infer_tp=layout.infer_tp,
        ep=layout.ep,
        pp_layers=list(layout.pp_layers) if layout.pp_layers else None,
    )
    return replace(cfg, parallel=parallel)


def layout_overrides(layout: ParallelLayout) -> list[str]:
    """Dotted overrides that make a run take ``layout`` (later overrides win)."""
    split = "[" + ",".join(map(str, layout.pp_layers)) + "]" if layout.pp_layers else "null"
    infer_tp = "null" if layout.infer_tp is None else str(layout.infer_tp)
    return [
        f"parallel.tp={layout.tp}",
        f"parallel.pp={layout.pp}",
        f"parallel.ep={layout.ep}",
        f"parallel.infer_tp={infer_tp}",
        f"parallel.pp_layers={split}",
    ]


def _candidates(p: ParallelConfig, dims: ModelDims, world: int) -> Iterator[ParallelLayout]:
    pairs = [(tp, pp) for tp in divisors(world) for pp in divisors(world // tp)]
    pairs.sort(key=lambda tp_pp: (abs(tp_pp[0] - p.tp), abs(tp_pp[1] - p.pp), tp_pp))
    for tp, pp in pairs:
        dp = world // (tp * pp)
        ep = max(e for e in divisors(p.ep) if dp % e == 0)
        infer_tp = p.infer_tp if p.infer_tp is not None and world % p.infer_tp == 0 else None
        split: tuple[int, ...] | None
        if pp == p.pp and p.pp_layers:
            split = tuple(p.pp_layers)
        else:
            split = uneven_split(dims.num_layers, pp)
        yield ParallelLayout(tp=tp, pp=pp, dp=dp, pp_layers=split, infer_tp=infer_tp, ep=ep)


def why_not(
    cfg: RunConfig, dims: ModelDims, layout: ParallelLayout, fits: FitCheck | None = None
) -> str | None:
    """None when the run can take ``layout``, else the reason (the model's shape, the batch
    sizes over its DP ranks, ``fits``)."""
    try:
        layout.check_model(dims.shape)
        validate(at_layout(cfg, layout), layout.world_size)
    except MegarlError as e:
        return str(e)
    return fits(cfg, layout) if fits is not None else None


def layout_for_world(
    parallel: ParallelConfig, dims: ModelDims, world: int, check: LayoutCheck
) -> ParallelLayout | None:
    """The layout the run (its ``parallel`` section, and ``check`` of each candidate) takes at
    ``world`` ranks, or None when none works."""
    for layout in _candidates(parallel, dims, world):
        if check(layout) is None:
            return layout
    return None


def largest_layout(
    parallel: ParallelConfig,
    dims: ModelDims,
    capacity: int,
    min_world: int,
    check: LayoutCheck,
    placeable: Callable[[int], bool] | None = None,
) -> ParallelLayout | None:
    """The layout of the largest world size from ``capacity`` down to ``min_world`` that works
    (and that the launcher can place, when it cannot place every size)."""
    for world in range(capacity, min_world - 1, -1):
        if placeable is not None and not placeable(world):
            continue
        layout = layout_for_world(parallel, dims, world, check)
        if layout is not None:
            return layout
    return None


def check_min_world_size(
    cfg: RunConfig, dims: ModelDims, world: int, fits: FitCheck | None = None
) -> None:
    """Before launch: ``trainer.elastic.min_world_size`` is at most the job's size and a world
    size a restart can take."""
    e = cfg.trainer.elastic
    if not e.max_restarts:
        return
    if e.min_world_size > world:
        raise ConfigError(
            f"trainer.elastic.min_world_size={e.min_world_size} is larger than the job's "
            f"{world} ranks; set it to at most {world}"
        )
    check = partial(why_not, cfg, dims, fits=fits)
    if layout_for_world(cfg.parallel, dims, e.min_world_size, check) is not None:
        return
    takes = [w for w in range(1, world + 1) if layout_for_world(cfg.parallel, dims, w, check)]
    raise ConfigError(
        f"trainer.elastic.min_world_size={e.min_world_size}: no layout of {cfg.model.path} takes "
        f"{e.min_world_size} ranks with this config (model shape, data.train_batch_size="
        f"{cfg.data.train_batch_size} and the mini-batch over the DP ranks); the world sizes up "
        f"to {world} it takes: {takes}. Set trainer.elastic.min_world_size to one of them"
    )
