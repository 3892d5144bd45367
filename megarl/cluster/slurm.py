"""The Slurm launcher: the elastic supervisor in the batch script, one ``srun`` job step per
attempt, one task per rank.

``megarl train CONFIG --launcher slurm --nproc-per-node 8`` inside an allocation (``sbatch`` or
``salloc``; not under ``srun``) starts ``srun --nodes=N --ntasks-per-node=8 ... python -m
megarl.entry CONFIG ...`` on the allocation's nodes; each task maps Slurm's variables to
``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (:func:`megarl.launch.under_launcher`) and meets the others
at the step's first node. srun's own lines pass through; the first ``srun: error: NODE: task N:
...`` line says which rank failed and where. Slurm places whole nodes: a node where a rank failed
is left out of later steps, and a restart takes a multiple of ``--nproc-per-node`` ranks (or
fewer ranks on one node). ``#SBATCH --no-kill`` keeps the allocation when a node fails.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Hashable, Sequence
from contextlib import suppress

from megarl.cluster.job import JobRequest, JobResult
from megarl.console import rank_env
from megarl.errors import ConfigError
from megarl.run.preemption import INTERRUPTED_EXIT_CODE, LAUNCHER_ENV

# srun's report of failed tasks ("srun: error: node3: task 5: Killed", "... tasks 0-3: Exited
# with exit code 1") and of a lost node ("srun: error: Node failure on node3").
_TASK_FAILED = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
_NODE_FAILED = re.compile(r"^srun: error: Node failure on (\S+)")
_EXIT_CODE = re.compile(r"Exited with exit code (\d+)")


def allocation_nodes() -> list[str]:
    """The allocation's host names, in Slurm's order."""
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        raise ConfigError(
            "--launcher slurm runs inside a Slurm allocation (in an sbatch script or an salloc "
            "shell); SLURM_JOB_ID is not set here. Outside Slurm use --launcher torchrun or ray"
        )
    if "SLURM_STEP_ID" in env:
        raise ConfigError(
            "--launcher slurm starts srun itself: run `megarl train ... --launcher slurm` once in "
            "the batch script, not under srun (under srun, one task per GPU runs `megarl train` "
            "without --launcher; see docs/slurm.md)"
        )
    out = subprocess.run(
        ["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def _first_failure(line: str) -> tuple[str, int | None, str] | None:
    """(node, rank or None, how) from one of srun's error lines, else None."""
    if m := _NODE_FAILED.match(line):
        return m.group(1), None, f"lost its node {m.group(1)} (Slurm: node failure)"
    if m := _TASK_FAILED.match(line):
        node, tasks, what = m.groups()
        rank = int(re.split(r"[,\-]", tasks)[0])
        if code := _EXIT_CODE.search(what):
            return node, rank, f"exited with code {code.group(1)} on {node}"
        return node, rank, f"ended on {node} ({what.strip()})"
    return None


class SlurmLauncher:
    name = "Slurm"
    can_grow = False  # an allocation's nodes do not come back

    def __init__(self, nnodes: int | None, nproc_per_node: int, verbose: bool = False) -> None:
        self.nodes = allocation_nodes()
        if nnodes is not None and nnodes > len(self.nodes):
            raise ConfigError(
                f"--nnodes {nnodes}: the allocation has {len(self.nodes)} node(s) "
                f"({','.join(self.nodes)}); ask sbatch for more or lower --nnodes"
            )
        self.nodes = self.nodes[: nnodes or len(self.nodes)]
        self.per_node, self.verbose = nproc_per_node, verbose
        self.interrupted = False
        self._first_signal: int | None = None
        self._attempt = 0

    def capacity(self, lost: Sequence[Hashable]) -> int:
        return len([n for n in self.nodes if n not in lost]) * self.per_node

    def placeable(self, world: int, lost: Sequence[Hashable]) -> bool:
        return world <= self.capacity(lost) and (
            world % self.per_node == 0 or world < self.per_node
        )

    def run(self, spec: JobRequest) -> JobResult:
        nodes = [n for n in self.nodes if n not in spec.avoid]
        count = -(-spec.world // self.per_node)
        use = nodes[:count]
        job = int(os.environ.get("SLURM_JOB_ID", "0"))
        env = dict(os.environ, **rank_env(self.verbose), **spec.env)
        env.update(MASTER_ADDR=use[0], MASTER_PORT=str(20000 + (job * 7 + self._attempt) % 20000))
        env[LAUNCHER_ENV] = str(os.getpid())  # the ranks take SIGUSR1/SIGUSR2 from this launcher
        self._attempt += 1
        cmd = [
            "srun",
            f"--nodes={count}",
            f"--ntasks={spec.world}",
            f"--ntasks-per-node={min(spec.world, self.per_node)}",
            f"--nodelist={','.join(use)}",
            "--kill-on-bad-exit=1",
            "--export=ALL",
            sys.executable,
            "-m",
            spec.module,
            *spec.args,
        ]
        self.interrupted, self._first_signal = False, None
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
        failures: list[tuple[str, int | None, str]] = []
        reader = threading.Thread(target=self._relay, args=(proc, failures), daemon=True)
        reader.start()
        old = {
            s: signal.signal(s, lambda signum, frame: self._forward(proc, signum))
            for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
        }
        try:
            code = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        reader.join(timeout=10.0)
        if code == 0:  # after a Ctrl-C the ranks stopped for cleanly, the status is 130
            return JobResult(INTERRUPTED_EXIT_CODE if self._first_signal == signal.SIGINT else 0)
        if not failures:
            return JobResult(code, how=f"srun exited with code {code}")
        node, rank, how = failures[0]
        return JobResult(code, rank, how, node)

    def _relay(self, proc: subprocess.Popen, failures: list) -> None:
        """srun's stderr (the ranks' too) to ours, noting the first failure it reports."""
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            found = _first_failure(line.rstrip("\n"))
            if found is not None and not failures:
                failures.append(found)

    def _forward(self, proc: subprocess.Popen, signum: int) -> None:
        """Preemption (SIGTERM, SIGUSR1) reaches the ranks as SIGUSR1, a first Ctrl-C as SIGUSR2
        (srun passes both on to every task: finish the step, checkpoint); a second Ctrl-C is
        srun's own abort (two SIGINTs within a second)."""
        self.interrupted = True
        second = self._first_signal is not None
        if not second:
            self._first_signal = signum
        with suppress(ProcessLookupError):
            if signum == signal.SIGINT and second:
                proc.send_signal(signal.SIGINT)
                proc.send_signal(signal.SIGINT)
            else:
                proc.send_signal(signal.SIGUSR2 if signum == signal.SIGINT else signal.SIGUSR1)

    def close(self) -> None:
        pass
