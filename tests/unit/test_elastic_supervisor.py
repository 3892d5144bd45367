"""The elastic supervisor's decisions, with a launcher that plays back scripted job endings."""

from __future__ import annotations

import io
import json
from pathlib import Path

from megarl.cluster.elastic import Supervisor
from megarl.cluster.job import JobRequest, JobResult
from megarl.config import load_config
from megarl.parallel import ParallelLayout
from megarl.run.elastic import ENV, AttemptRecord
from tests.assets import tiny_char_llama_dir


class ScriptedLauncher:
    name = "scripted"

    def __init__(self, results: list[JobResult], slots: int, can_grow: bool = False):
        self.results, self.slots, self.can_grow = list(results), slots, can_grow
        self.specs: list[JobRequest] = []
        self.interrupted = False
        self.capacity_calls = 0

    def run(self, spec: JobRequest) -> JobResult:
        self.specs.append(spec)
        return self.results.pop(0)

    def capacity(self, lost) -> int:
        self.capacity_calls += 1
        return self.slots - len(lost)

    def placeable(self, world: int, lost) -> bool:
        return world <= self.capacity(lost)

    def close(self) -> None:
        pass


def _setup(tmp_path: Path, *extra: str, checkpoint_step: int | None = 2, logged: int = 3):
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"model.path={tiny_char_llama_dir()}",
            "data.train_files=[unused.parquet]",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "parallel.tp=2",
            f"trainer.output_dir={out}",
            "trainer.elastic.max_restarts=2",
            "trainer.elastic.wait_s=0",
            *extra,
        ],
    )
    if checkpoint_step is not None:
        name = f"step_{checkpoint_step:08d}"
        (out / "checkpoints" / name).mkdir(parents=True)
        (out / "checkpoints" / "latest").write_text(name + "\n")
    out.mkdir(exist_ok=True)
    lines = [json.dumps({"step": s, "reward/mean": 0.5}) for s in range(1, logged + 1)]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return cfg, out


def test_a_killed_rank_restarts_the_job_smaller_from_the_checkpoint(tmp_path):
    cfg, out = _setup(tmp_path)
    launcher = ScriptedLauncher(
        [JobResult(137, failed_rank=3, how="was killed by SIGKILL", slot=3), JobResult(0)], 4
    )
    console = io.StringIO()
    layout = ParallelLayout(tp=2, pp=1, dp=2)
    code = Supervisor(cfg, ["run.yaml", "x=1"], layout, launcher, console=console).run()
    assert code == 0
    first, second = launcher.specs
    assert first.world == 4 and list(first.args) == ["run.yaml", "x=1"] and not first.avoid
    assert AttemptRecord(**json.loads(first.env[ENV])) == AttemptRecord(0, 4, 2, 1, 2, 0)
    # restarted at TP2 x DP1 (3 slots left, 3 ranks fit no layout), the lost slot avoided
    assert second.world == 2 and list(second.avoid) == [3]
    assert list(second.args[:2]) == ["run.yaml", "x=1"]
    assert "parallel.tp=2" in second.args and "parallel.pp=1" in second.args
    assert AttemptRecord(**json.loads(second.env[ENV])) == AttemptRecord(1, 2, 2, 1, 1, 1)
    text = console.getvalue()
    assert "elastic restart 1/2: rank 3 was killed by SIGKILL" in text
    assert "from step_00000002 (step 2) at TP2xPP1xDP1 (2 ranks) instead of TP2xPP1xDP2" in text
    assert "1 step(s) since the checkpoint run again" in text
    [event] = [json.loads(line) for line in (out / "elastic.jsonl").read_text().splitlines()]
    assert event["old_world_size"] == 4 and event["new_world_size"] == 2
    assert event["checkpoint"] == "step_00000002" and event["steps_lost"] == 1


def test_user_errors_interrupts_and_success_are_not_restarted(tmp_path):
    cfg, _ = _setup(tmp_path)
    for code in (0, 2, 130):
        launcher = ScriptedLauncher([JobResult(code, 0, "exited", 0)], 4)
        assert Supervisor(cfg, [], ParallelLayout(tp=2, dp=2), launcher).run() == code
        assert len(launcher.specs) == 1
    preempted = ScriptedLauncher([JobResult(137, 0, "was killed by SIGKILL", 0)], 4)
    preempted.interrupted = True  # the job was being stopped by a signal
    assert Supervisor(cfg, [], ParallelLayout(tp=2, dp=2), preempted).run() == 137
    assert len(preempted.specs) == 1


def test_gives_up_after_max_restarts_or_below_min_world_size(tmp_path):
    cfg, _ = _setup(tmp_path)
    crash = [JobResult(1, 0, "exited with code 1", None)] * 3
    launcher = ScriptedLauncher(crash, 4)  # no slot known: restarted at the same size
    console = io.StringIO()
    sup = Supervisor(cfg, [], ParallelLayout(tp=2, dp=2), launcher, console=console)
    assert sup.run() == 1
    assert [s.world for s in launcher.specs] == [4, 4, 4]
    assert "giving up" in console.getvalue() and "max_restarts=2" in console.getvalue()

    cfg, _ = _setup(tmp_path / "floor", "trainer.elastic.min_world_size=4")
    launcher = ScriptedLauncher([JobResult(137, 1, "was killed by SIGKILL", 1)], 4)
    console = io.StringIO()
    assert Supervisor(cfg, [], ParallelLayout(tp=2, dp=2), launcher, console=console).run() == 137
    assert "3 rank(s) are left" in console.getvalue()
    assert "min_world_size=4" in console.getvalue()


def test_waits_for_a_replacement_and_takes_the_full_size_back(tmp_path):
    cfg, _ = _setup(tmp_path, "trainer.elastic.wait_s=30", "trainer.resume=never")

    class Regrowing(ScriptedLauncher):
        def capacity(self, lost) -> int:  # the lost node's replacement joins on the 3rd look
            self.capacity_calls += 1
            return 4 if self.capacity_calls >= 3 else 2

    launcher = Regrowing(
        [JobResult(1, 2, "was lost with its Ray actor", "node-b"), JobResult(0)], 4, can_grow=True
    )
    console = io.StringIO()
    sup = Supervisor(cfg, [], ParallelLayout(tp=2, dp=2), launcher, console=console)
    assert sup.run() == 0
    assert launcher.specs[1].world == 4 and launcher.capacity_calls >= 3
    assert "waiting up to 30 s" in console.getvalue()
    # resume=never: the checkpoint on disk predates this job, so the restart starts afresh
    assert "trainer.resume=auto" not in launcher.specs[1].args
    assert "from the start (no checkpoint yet)" in console.getvalue()


def test_a_restart_names_the_newest_intact_checkpoint_not_a_damaged_newer_one(tmp_path):
    """The supervisor's notion of intact is the ranks' (megarl.run.verification): a newer
    checkpoint whose manifest does not match its files is not the one the restart reports."""
    import megarl.checkpoint.manifest as manifest

    cfg, out = _setup(tmp_path, checkpoint_step=2, logged=5)
    newer = out / "checkpoints" / "step_00000004"
    (newer / "trainer").mkdir(parents=True)
    (newer / "trainer" / "trainer_state.pt").write_bytes(b"state")
    manifest.write(newer, [manifest.record(newer, "trainer/trainer_state.pt")])
    (newer / "trainer" / "trainer_state.pt").write_bytes(b"st")  # truncated after the save
    (out / "checkpoints" / "latest").write_text("step_00000004\n")
    launcher = ScriptedLauncher(
        [JobResult(137, failed_rank=3, how="was killed by SIGKILL", slot=3), JobResult(0)], 4
    )
    console = io.StringIO()
    layout = ParallelLayout(tp=2, pp=1, dp=2)
    assert Supervisor(cfg, ["run.yaml"], layout, launcher, console=console).run() == 0
    assert "from step_00000002 (step 2)" in console.getvalue()
    [event] = [json.loads(line) for line in (out / "elastic.jsonl").read_text().splitlines()]
    assert event["checkpoint"] == "step_00000002" and event["steps_lost"] == 3
