"""torch.profiler traces of chosen training steps (``trainer.profile_steps``).

Steps are numbered as they are logged: 1-based, step 1 is the first step of the run (a resumed
run keeps counting from its checkpoint, so a step already done is never profiled again). Each
listed step writes one Chrome trace per rank, ``<output_dir>/profile/step_<N>_rank<R>.json``
(open it in https://ui.perfetto.dev or chrome://tracing); the trace covers the whole step:
rollout, rewards, experience, updates and a checkpoint save when that step has one. CPU
activities are always recorded, CUDA kernels too when CUDA is available. Steps not listed run
without any profiler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from megarl.errors import ConfigError
from megarl.files import temporary_beside


class StepProfiler:
    """Profile the listed 1-based steps; any other step runs bare."""

    def __init__(
        self, steps: Sequence[int], output_dir: str | Path, *, record_shapes: bool = False
    ) -> None:
        bad = [s for s in steps if not isinstance(s, int) or isinstance(s, bool) or s < 1]
        if bad:
            raise ConfigError(
                f"trainer.profile_steps={list(steps)}: step numbers are 1-based as logged "
                f"(the first step is 1); {bad} cannot be profiled"
            )
        self.steps = frozenset(steps)
        self.dir = Path(output_dir) / "profile"
        self.record_shapes = record_shapes

    @classmethod
    def from_config(cls, trainer_cfg) -> StepProfiler:
        return cls(trainer_cfg.profile_steps, trainer_cfg.output_dir)

    def trace_path(self, step: int, rank: int) -> Path:
        return self.dir / f"step_{step}_rank{rank}.json"

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run the body under torch.profiler when ``step`` (1-based) is listed, then write its trace."""
        if step not in self.steps:
            yield
            return
        import torch
        import torch.distributed as dist
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        with profile(activities=activities, record_shapes=self.record_shapes) as prof:
            yield
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_path(step, rank)
        with temporary_beside(path) as (_, tmp):  # made afresh, then written by its name
            prof.export_chrome_trace(str(tmp))
        tmp.replace(path)

    def iterate(self, steps: Iterable[int]) -> Iterator[int]:
        """Yield 0-based loop indices, each one's loop body running inside :meth:`step` (index + 1)."""
        for index in steps:
            with self.step(index + 1):
                yield index


__all__ = ["StepProfiler"]
