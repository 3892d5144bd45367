"""Start a megarl entry point on N local processes (torchrun; one process directly), or run it in
place when already launched (torchrun or Slurm ``srun`` set RANK/WORLD_SIZE)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from megarl import platform
from megarl.child_wait import wait_for_exit
from megarl.console import is_verbose
from megarl.errors import ConfigError
from megarl.hardening import make_undumpable
from megarl.lean_imports import import_megatron_lean
from megarl.loopback import rank_store
from megarl.parent_death import end_with_parent
from megarl.parked_rank import ParkedRank
from megarl.rank_exit import FAILURE_FILE_ENV, exit_code_of, failure_note
from megarl.rank_process_env import (
    LaunchIdentity,
    local_rank_env,
    rendezvous_port,
    single_rank_command,
)
from megarl.shm_segments import RUN_SEGMENTS_ENV, remove_run_segments
from megarl.world_split import TRAINER, SplitWorld, WorldSplit, init_split_world

DEFAULT_STORE_TIMEOUT = timedelta(minutes=30)  # torch's default for its process groups


def under_launcher() -> bool:
    """Whether this process is already one rank of a job (torchrun, or one ``srun`` task per GPU)."""
    _adopt_slurm_env()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _adopt_slurm_env() -> None:
    """Map Slurm's variables to torch.distributed's when started by ``srun`` without torchrun.

    Only inside a job step (``SLURM_STEP_ID``: a task of ``srun``), not in the batch script or an
    ``salloc`` shell. Rendezvous needs ``MASTER_ADDR``/``MASTER_PORT`` exported by the job script
    (e.g. ``MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)``).
    """
    env = os.environ
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and "RANK" not in env:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise ConfigError(
                "started by srun without torchrun, but MASTER_ADDR/MASTER_PORT are not set: "
                'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) '
                "and MASTER_PORT=<free port> in the job script"
            )
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")


def run_torchrun(
    module: str,
    args: Sequence[str],
    nproc: int,
    threads_per_rank: int | None = None,
    verbose: bool = False,
    env_extra: Mapping[str, str] | None = None,
    on_signal: Callable[[int], None] | None = None,
    parked: ParkedRank | None = None,
) -> int:
    """Run ``python -m module args`` on ``nproc`` local ranks, quiet unless ``verbose``
    (megarl/console.py); returns the exit code of the rank that failed, or 0. ``env_extra``: more
    variables for the ranks; ``on_signal`` is told of each signal the launcher passes on to them.

    Several ranks run under torchrun (through megarl.quiet_torchrun). One rank runs as a direct
    child with the environment torchrun would give it (megarl.rank_process_env): the same
    program, without torchrun's interpreter, elastic agent and rendezvous (about 1.5 s of every
    one-process launch); ``parked``: that rank, already started (megarl.parked_rank)."""
    cuda = torch.cuda.is_available()
    identity = parked.identity if parked is not None else LaunchIdentity.new(os.environ)
    env = local_rank_env(os.environ, nproc, cuda, identity, threads_per_rank, verbose, env_extra)
    if nproc == 1:
        cmd = single_rank_command(module, args)
    else:
        cmd = [
            sys.executable,
            "-m",
            "megarl.quiet_torchrun",
            f"--nproc-per-node={nproc}",
            "--master-addr",
            "127.0.0.1",  # one machine: the ranks meet on loopback, where the store listens
            "--master-port",
            rendezvous_port(env, identity),
            "-m",
            module,
            *args,
        ]
    # torchrun (or the one rank) runs in its own session so that a terminal's or a scheduler's
    # signal reaches it only through _forwarding_signals: otherwise torchrun would end the ranks
    # on SIGTERM itself (after 30 s) and exit non-zero, where megarl wants them to finish the
    # step and exit 0.
    proc = _start(cmd, env, module, args, nproc, parked, verbose)
    direct = nproc == 1

    def rank_pids() -> list[int]:
        return [proc.pid] if direct else _children(proc.pid)

    ranks: set[int] = set()
    try:
        with _forwarding_signals(proc, on_signal, rank_pids) as stop:
            # woken by the job's end, not by polling (megarl.child_wait); every 2 s meanwhile
            # the ranks' process ids are noted for the clean-up below
            while (code := wait_for_exit(proc, 2.0)) is None:
                ranks.update(rank_pids())
        if direct and code != 0:
            code = _report_single_rank_failure(code, env.get(FAILURE_FILE_ENV))
        return stop.exit_code(code)
    finally:
        # Helpers a rank started (e.g. megatron's checkpoint-writer Manager) outlive a rank that
        # was killed or hung; torchrun starts each rank in its own session, and the helpers
        # stay in the rank's process group: end those groups with the job.
        for group in (proc.pid, *ranks):
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        remove_run_segments(env[RUN_SEGMENTS_ENV])


def _start(
    cmd: list[str],
    env: dict[str, str],
    module: str,
    args: Sequence[str],
    nproc: int,
    parked: ParkedRank | None,
    verbose: bool,
) -> subprocess.Popen:
    """The job's process: the parked rank when it can run this launch, else a new one."""
    if parked is not None:
        differ = parked.mismatch(module, env) if nproc == 1 else [f"{nproc} ranks"]
        if not differ:
            return parked.release(args, env)
        if verbose:
            print(
                f"megarl: not using the rank started early: {', '.join(differ)} differ",
                file=sys.stderr,
            )
        parked.discard()
    return subprocess.Popen(cmd, env=env, start_new_session=True)


def _report_single_rank_failure(returncode: int, failure_file: str | None) -> int:
    """What megarl.quiet_torchrun does for a failed rank, for the one rank run directly: the
    failure record for the elastic supervisor, the one-line note, a shell's exit status."""
    rank_code = returncode  # Popen: -N for a rank killed by signal N, as torchrun reports it
    if failure_file:
        Path(failure_file).write_text(json.dumps({"rank": 0, "exit_code": rank_code}))
    note = failure_note(0, rank_code) if not is_verbose() else None
    if note:
        print(note, file=sys.stderr, flush=True)
    return exit_code_of(rank_code)


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


class _Stop:
    """What the launcher was asked by signals: the first one (a graceful stop of the ranks) and
    whether a second one ended the job at once. ``on_signal`` is told of each one."""

    def __init__(
        self,
        proc: subprocess.Popen,
        on_signal: Callable[[int], None] | None = None,
        rank_pids: Callable[[], list[int]] | None = None,
    ) -> None:
        self.proc = proc
        self.on_signal = on_signal
        # the ranks: torchrun's children, or the process itself when it is the one rank
        self.rank_pids = rank_pids or (lambda: _children(proc.pid))
        self.first: signal.Signals | None = None
        self.killed = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.on_signal is not None:
            self.on_signal(signum)
        ranks = self.rank_pids()
        if self.first is not None:
            print(
                f"megarl: second {sig.name}: stopping at once (what the ranks did since their "
                "last checkpoint is lost)",
                file=sys.stderr,
                flush=True,
            )
            self.killed = True
            for group in {self.proc.pid, *ranks}:  # each rank leads its own process group
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
            return
        self.first = sig
        again = "press Ctrl-C again" if sig == signal.SIGINT else "send it again"
        print(
            f"megarl: {sig.name} received: asking the {len(ranks)} ranks to finish the current "
            f"step and save a checkpoint ({again} to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        # SIGUSR2 tells the ranks it was an interruption (their exit status is then 130).
        forward = signal.SIGUSR2 if sig == signal.SIGINT else signal.SIGUSR1
        for pid in ranks:
            with suppress(ProcessLookupError):
                os.kill(pid, forward)

    def exit_code(self, code: int) -> int:
        """The command's exit status: the job's, or 128 + the signal for a stop by a signal
        after which the job ended cleanly (130 for Ctrl-C) or was ended at once."""
        if self.first is None:
            return code
        if self.killed or (code == 0 and self.first == signal.SIGINT):
            return 128 + self.first.value
        return code


@contextmanager
def _forwarding_signals(
    proc: subprocess.Popen,
    on_signal: Callable[[int], None] | None = None,
    rank_pids: Callable[[], list[int]] | None = None,
) -> Iterator[_Stop]:
    """SIGTERM/SIGUSR1/SIGINT to the launcher -> every rank finishes its step, checkpoints and
    exits (SIGUSR1 to the ranks; SIGUSR2 for SIGINT); a second one ends the job at once."""
    stop = _Stop(proc, on_signal, rank_pids)
    signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    old = {s: signal.signal(s, stop.handle) for s in signals}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def init_distributed(timeout_s: float | None = None) -> tuple[int, int]:
    """Initialise the default process group from the launcher's environment; returns (rank, world).

    ``timeout_s``: how long a collective may wait for the other ranks (None: torch's default).
    """
    make_undumpable()
    end_with_parent()
    _adopt_slurm_env()
    import_megatron_lean()  # every trainer rank imports it: without what megarl never uses
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = rank_store(rank, world, timeout or DEFAULT_STORE_TIMEOUT)
        if store is None:
            dist.init_process_group(platform.distributed_backend(), timeout=timeout)
        else:  # a one-machine job without torchrun's agent store: rank 0's, on loopback
            dist.init_process_group(
                platform.distributed_backend(),
                store=store,
                rank=rank,
                world_size=world,
                timeout=timeout,
            )
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and not torch.cuda.is_available():
        torch.set_num_threads(int(threads))
    platform.adapt_megatron_for_cpu()
    return dist.get_rank(), dist.get_world_size()


def job_split(rollout_ranks: int) -> WorldSplit:
    """The split of this job (rollout.placement.mode=async) from the launcher's environment."""
    _adopt_slurm_env()
    return WorldSplit(int(os.environ["WORLD_SIZE"]), rollout_ranks)


def init_split(rollout_ranks: int, timeout_s: float | None = None) -> SplitWorld:
    """Asynchronous training's start-up: this process's default group over its own role's ranks
    (the trainers' or the rollout group's, :mod:`megarl.world_split`); the CPU adaptation of
    megatron on the trainers only."""
    make_undumpable()
    end_with_parent()
    split = job_split(rollout_ranks)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else 1800.0)
    world = init_split_world(split, platform.distributed_backend(), timeout)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and not torch.cuda.is_available():
        torch.set_num_threads(int(threads))
    if world.role == TRAINER:
        import_megatron_lean()
        platform.adapt_megatron_for_cpu()
    return world
