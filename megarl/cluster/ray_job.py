"""The Ray launcher: one Ray actor per rank, each running the same rank entry point torchrun runs.

``megarl train CONFIG --launcher ray [--address auto|HOST:PORT] [--nnodes N] [--nproc-per-node M]``
connects to a Ray cluster (or starts a local instance with one CPU per rank), reserves one
bundle per rank (a GPU, or a CPU on a CPU-only cluster) in a placement group, each bundle pinned
to the node :mod:`megarl.cluster.placement` chose, and starts a
:class:`~megarl.cluster.rank_agent.RankAgent` in each. The agents start the ranks with
``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set (rank 0's node and a
free port there as the rendezvous); torch.distributed then connects them as under torchrun.

The driver streams every rank's output to its own stdout/stderr, passes SIGTERM/SIGUSR1 on as
SIGUSR1 (finish the step, checkpoint, exit 0) and SIGINT as SIGINT, and ends the job as torchrun
does: when a rank fails, the others are stopped, the failed rank's output comes last (a megarl
user error stays the last line) and its exit code is the driver's.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING

import torch

from megarl.cluster import placement
from megarl.cluster.job import JobRequest, JobResult
from megarl.cluster.rank_agent import Poll, RankAgent
from megarl.console import rank_env
from megarl.errors import ConfigError, LaunchError
from megarl.rank_exit import describe_exit, exit_code_of, first_cause, is_consequence
from megarl.rank_process_env import LOOPBACK_IFNAMES
from megarl.run.preemption import INTERRUPTED_EXIT_CODE, LAUNCHER_ENV
from megarl.shm_segments import RUN_SEGMENTS_ENV, new_segment_prefix

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

EXTRA = "megarl[ray]"
CONNECT_TIMEOUT_S = 30.0  # a cluster's GCS must answer within this; a local start too
PLACEMENT_TIMEOUT_S = 120.0  # the cluster must place every rank's bundle within this
POLL_S = 0.2
# How long the launcher keeps polling when every failed rank only reacted to another's failure
# (it lost a peer, or was sent SIGTERM): the rank that caused it may not have been seen yet.
CAUSE_GRACE_S = 10.0
# Ray's own minimum; the ranks pass nothing through Ray's object store.
LOCAL_OBJECT_STORE_BYTES = 80 * 2**20
# The driver's variables the ranks get on every node (their node's environment otherwise).
FORWARDED_PREFIXES = (
    "MEGARL_",
    "OMP_",
    "MKL_",
    "VLLM_",
    "TORCH_",
    "NCCL_",
    "GLOO_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "WANDB_",
    "MLFLOW_",
    "PYTHONPATH",
)
ACTOR_DIED = "was lost with its Ray actor (its node left the cluster or the actor was killed)"


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError as e:
        raise ConfigError(
            f"--launcher ray needs Ray, which is not installed in this environment ({e}); "
            f"install the extra: pip install '{EXTRA}' (scripts/setup.sh does)"
        ) from None
    return ray


def _current_cluster_file() -> Path:
    return Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"


def resolve_address(address: str | None) -> str:
    """``local`` (start a Ray instance here) or the HOST:PORT of a running cluster's head."""
    if address is None:
        address = os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        return address
    if address.startswith("ray://"):
        raise ConfigError(
            f"--address {address}: Ray Client addresses are not supported; run megarl on the "
            "cluster, e.g. `ray job submit --address http://HEAD:8265 -- megarl train CONFIG "
            "--launcher ray` (docs/ray.md)"
        )
    if address.startswith(("http://", "https://")):
        raise ConfigError(
            f"--address {address} is the address of Ray's dashboard (for `ray job submit`); "
            "--address takes the head's GCS address HOST:PORT (port 6379 unless `ray start "
            "--head --port` chose another), or auto on a node of the cluster"
        )
    if address == "auto":
        file = _current_cluster_file()
        found = os.environ.get("RAY_ADDRESS") or (
            file.read_text().strip() if file.is_file() else ""
        )
        if not found or found == "auto":
            raise ConfigError(
                "--address auto: no Ray cluster was started on this machine (RAY_ADDRESS is "
                f"unset and {file} does not exist); start one with `ray start --head`, give "
                "--address HOST:PORT, or leave --address out for a local Ray instance"
            )
        return resolve_address(found)
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"--address {address!r} must be auto or HOST:PORT of the Ray head (e.g. 10.0.0.1:6379)"
        )
    return address


def _probe(address: str, timeout_s: float) -> None:
    """The head's port accepts connections (fails fast for a wrong host or port)."""

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise LaunchError(
            f"no Ray cluster answers at {address} ({e}); check the address, or start the head "
            f"there with `ray start --head --port {port}`"
        ) from None


def _init_within(ray: ModuleType, timeout_s: float, what: str, **kwargs: object) -> None:
    """``ray.init(**kwargs)`` to a running cluster, bounded in time: Ray itself keeps retrying a
    GCS that does not answer for minutes. (Not for a local start: see :meth:`connect`.)"""
    outcome: dict[str, BaseException | None] = {}

    def connect() -> None:
        try:
            ray.init(**kwargs)
            outcome["error"] = None
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=connect, name="ray-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "error" not in outcome:
        # The connecting thread cannot be stopped, and Ray's shutdown hooks crash on the
        # half-made connection (std::bad_alloc, SIGABRT): end the process before they run.
        atexit.register(_exit_now, LaunchError.exit_code)
        raise LaunchError(
            f"{what} did not answer within {timeout_s:.0f} s; check that it is a Ray head "
            "(`ray status --address HOST:PORT` on it) and that its Ray version matches this one "
            f"({ray.__version__})"
        )
    if outcome["error"] is not None:
        raise LaunchError(f"cannot connect to {what}: {outcome['error']}") from None


def _use_token_if_present() -> None:
    """Ray (2.5x) heads authenticate drivers with a token by default; a driver joining a
    cluster sends one only in token mode. Take that mode when a token is at hand (Ray's own
    places: ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``), unless
    ``RAY_AUTH_MODE`` says otherwise."""
    env = os.environ
    token_file = Path(env.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if "RAY_AUTH_MODE" not in env and (env.get("RAY_AUTH_TOKEN") or token_file.is_file()):
        env["RAY_AUTH_MODE"] = "token"


# Ray's switch for its node address: off, a node takes the loopback address, and Ray's servers
# (GCS, raylet, workers, agents) listen on it (measured with Ray 2.60: on, they listen on `::`
# and on the machine's address). Named for Windows and macOS, where it is off by default.
RAY_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _local_on_loopback() -> None:
    """A local Ray instance (one machine, nothing joins it) listens on loopback only."""
    os.environ[RAY_CLUSTER_SWITCH] = "0"
    if "ray._private.ray_constants" in sys.modules:  # imported already: it read the switch then
        import ray._private.ray_constants as constants

        constants.ENABLE_RAY_CLUSTER = False


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _nodes(ray: ModuleType, kind: str) -> list[placement.NodeSlots]:
    """The cluster's live nodes and the rank slots each holds (its GPUs, or its CPUs)."""
    out = []
    for n in ray.nodes():
        slots = int(n.get("Resources", {}).get(kind, 0))
        if n.get("Alive") and slots > 0:
            out.append(placement.NodeSlots(n["NodeID"], n["NodeManagerAddress"], slots))
    return out


@dataclass
class _Rank:
    agent: ActorHandle
    node: placement.NodeSlots
    local_rank: int
    poll: Poll | None = None
    lost: str | None = None  # why its actor is gone


class RayLauncher:
    """The launcher of :mod:`megarl.cluster.job` on a Ray cluster."""

    name = "Ray"

    def __init__(self, ray: ModuleType, where: str, one_node: bool, verbose: bool, local: bool):
        self.ray, self.where, self.one_node, self.verbose = ray, where, one_node, verbose
        self.local = local
        self.kind = "GPU" if ray.cluster_resources().get("GPU", 0) >= 1 else "CPU"
        self.interrupted = False
        self._pending: list[int] = []
        self._first_signal: int | None = None
        self._driver_node = ray.get_runtime_context().get_node_id()

    @classmethod
    def connect(
        cls, address: str | None, nnodes: int, nproc_per_node: int, verbose: bool
    ) -> RayLauncher:
        """Connect (or start a local instance) and check the job fits, before any rank starts."""
        if importlib.util.find_spec("ray") is None:
            import_ray()  # raises, naming the extra
        target = resolve_address(address)
        if target != "local":
            _probe(target, min(10.0, CONNECT_TIMEOUT_S))
            _use_token_if_present()  # before Ray is imported: it reads the mode at import
        else:
            _local_on_loopback()  # before Ray is imported: it reads the setting at import
        ray = import_ray()
        world = nnodes * nproc_per_node
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network calls from the driver
        common = {
            "log_to_driver": False,  # the driver streams the ranks' output itself
            "logging_level": logging.INFO if verbose else logging.ERROR,
        }
        if not verbose:  # Ray's own INFO/WARNING lines at connect ("Connected to Ray cluster")
            logging.getLogger("ray").setLevel(logging.ERROR)
        if target == "local":
            # In the main thread: the processes Ray starts here die with the thread that started
            # them (parent-death signal). Ray bounds a local start itself.
            where = "the local Ray instance"
            ray.init(**common, **_local_resources(world))
        else:
            where = f"the Ray cluster at {target}"
            _init_within(ray, CONNECT_TIMEOUT_S, where, address=target, **common)
        launcher = cls(ray, where, nnodes == 1, verbose, local=target == "local")
        try:
            launcher._check_room(world, nnodes)
        except BaseException:
            launcher.close()
            raise
        return launcher

    def _check_room(self, world: int, nnodes: int) -> None:
        nodes = _nodes(self.ray, self.kind)
        room = placement.capacity(nodes, [], self.one_node)
        if world <= room:
            return
        unit = "GPU" if self.kind == "GPU" else "CPU"
        held = ", ".join(f"{n.ip}: {n.slots}" for n in nodes) or "none"
        where = "its largest node has" if self.one_node else "it has"
        raise ConfigError(
            f"{self.where} cannot hold {world} ranks (one {unit} each): {where} {room} {unit}s "
            f"({len(nodes)} node(s) with {unit}s; per node {held}). Lower --nproc-per-node"
            + (" or add --nnodes to spread over nodes" if self.one_node and nnodes == 1 else "")
            + ", or add nodes to the cluster"
        )

    @property
    def can_grow(self) -> bool:
        return not self.local  # nodes may join a cluster; a local instance stays as it is

    def placeable(self, world: int, lost: Sequence[Hashable]) -> bool:
        return world <= self.capacity(lost)

    def capacity(self, lost: Sequence[Hashable]) -> int:
        return placement.capacity(_nodes(self.ray, self.kind), lost, self.one_node)

    def run(self, spec: JobRequest) -> JobResult:
        self.interrupted, self._first_signal = False, None
        pg, ranks = self._place(spec)
        try:
            with self._forwarding_signals():
                self._start(spec, ranks)
                return self._watch(ranks)
        finally:
            self._stop(ranks)
            self.ray.util.remove_placement_group(pg)

    def _place(self, spec: JobRequest) -> tuple[PlacementGroup, list[_Rank]]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        nodes = _nodes(self.ray, self.kind)
        placed = placement.plan(nodes, spec.avoid, spec.world, self.one_node, self._driver_node)
        if placed is None:
            raise LaunchError(
                f"{self.where} has no room for {spec.world} ranks now "
                f"({placement.capacity(nodes, spec.avoid, self.one_node)} {self.kind} slots usable)"
            )
        table = placement.rank_table(placed)
        unit = {"GPU": 1, "CPU": 1} if self.kind == "GPU" else {"CPU": 1}
        bundles = [{**unit, f"node:{node.ip}": 0.001} for node, _ in table]
        pg = placement_group(bundles, strategy="PACK")
        if not self._ready(pg, spec.world):
            self.ray.util.remove_placement_group(pg)
            raise LaunchError(
                f"{self.where} did not place {spec.world} ranks ({self.kind} each) within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; other jobs may hold its resources (`ray status`)"
            )
        actor = self.ray.remote(RankAgent)
        ranks = []
        for i, (node, local) in enumerate(table):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
            options: dict[str, object] = {"num_cpus": 1, "num_gpus": 1 if self.kind == "GPU" else 0}
            if "PYTHONPATH" in os.environ:  # the actor imports megarl from where the driver does
                options["runtime_env"] = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
            agent = actor.options(scheduling_strategy=strategy, **options).remote()
            ranks.append(_Rank(agent, node, local))
        return pg, ranks

    def _ready(self, pg: PlacementGroup, world: int) -> bool:
        waited = 0.0
        while waited < PLACEMENT_TIMEOUT_S:
            ready, _ = self.ray.wait([pg.ready()], timeout=10.0)
            if ready:
                return True
            waited += 10.0
            print(
                f"megarl: waiting for {self.where} to place {world} ranks ({waited:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        return False

    def _start(self, spec: JobRequest, ranks: list[_Rank]) -> None:
        infos = self.ray.get(
            [r.agent.describe.remote() for r in ranks], timeout=PLACEMENT_TIMEOUT_S
        )
        port = self.ray.get(ranks[0].agent.free_port.remote())
        base = _rank_base_env(spec, self.verbose)
        base.update(MASTER_ADDR=infos[0]["ip"], MASTER_PORT=str(port), WORLD_SIZE=str(spec.world))
        if self.local:  # one machine: the ranks' gloo/NCCL sockets on loopback too
            for key, value in LOOPBACK_IFNAMES.items():
                base.setdefault(key, value)
        on_node: dict[str, list[int]] = {}
        for i, r in enumerate(ranks):
            on_node.setdefault(r.node.node_id, []).append(i)
        starts = []
        for i, (r, info) in enumerate(zip(ranks, infos, strict=True)):
            env = dict(base, RANK=str(i), LOCAL_RANK=str(r.local_rank))
            env["LOCAL_WORLD_SIZE"] = str(len(on_node[r.node.node_id]))
            if self.kind == "GPU":  # every GPU of the job on this node, as torchrun shows them
                gpus = {j: infos[j]["gpu_ids"][0] for j in on_node[r.node.node_id]}
                visible = placement.visible_devices(gpus, on_node[r.node.node_id])
                env["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
                env["LOCAL_RANK"] = str(visible.index(info["gpu_ids"][0]))
            if "OMP_NUM_THREADS" not in base:  # as megarl.launch: 4 per GPU rank, else a share
                share = info["cpus"] // len(on_node[r.node.node_id])
                env["OMP_NUM_THREADS"] = "4" if self.kind == "GPU" else str(max(1, share))
            starts.append(r.agent.start.remote(["-m", spec.module, *spec.args], env, os.getcwd()))
        problems = [p for p in self.ray.get(starts) if p]
        if problems:
            raise LaunchError(problems[0])

    def _watch(self, ranks: list[_Rank]) -> JobResult:
        """Stream output until every rank ended well, or one failed; then the failure."""
        first_failure_at: float | None = None
        while True:
            self._forward_pending(ranks)
            self._poll(ranks)
            failed = [i for i, r in enumerate(ranks) if r.lost or (r.poll and r.poll.exit_code)]
            if failed:
                first_failure_at = first_failure_at or time.monotonic()
                waited = time.monotonic() - first_failure_at
                if _cause_seen(ranks, failed) or waited >= CAUSE_GRACE_S:
                    return self._fail(ranks, failed)
            if all(r.poll is not None and r.poll.exit_code == 0 for r in ranks):
                # a Ctrl-C the ranks stopped for cleanly: the command's status is 130
                return JobResult(
                    INTERRUPTED_EXIT_CODE if self._first_signal == signal.SIGINT else 0
                )
            time.sleep(POLL_S)

    def _poll(self, ranks: list[_Rank]) -> None:
        from ray.exceptions import RayActorError

        live = [r for r in ranks if not r.lost and not (r.poll and r.poll.exit_code is not None)]
        futures = [r.agent.poll.remote() for r in live]
        for r, future in zip(live, futures, strict=True):
            try:
                r.poll = self.ray.get(future, timeout=60.0)
            except RayActorError:
                r.lost = ACTOR_DIED
                continue
            _write(r.poll)

    def _fail(self, ranks: list[_Rank], failed: list[int]) -> JobResult:
        """Stop the others; the first failure's output last, then its note and exit code."""

        # a lost actor first (its rank could not report), then megarl.rank_exit's order
        lost = [i for i in failed if ranks[i].lost or ranks[i].poll is None]
        first = lost[0] if lost else first_cause({i: _exit_of(ranks[i]) for i in failed})
        last_words: Poll | None = None
        for i, r in enumerate(ranks):
            if r.lost:
                continue
            try:
                tail = self.ray.get(r.agent.stop.remote(), timeout=60.0)
            except Exception:  # its actor died meanwhile: nothing more to read
                continue
            if i == first:
                last_words = tail
            else:
                _write(tail)
        if last_words is not None:
            _write(last_words)
        r = ranks[first]
        if r.lost:
            how, code = r.lost, 1
        else:
            assert r.poll is not None and r.poll.exit_code is not None
            how, code = describe_exit(r.poll.exit_code), exit_code_of(r.poll.exit_code)
        if code != 2:  # a megarl user error: the rank's own message stays the last line
            print(f"megarl: rank {first} {how}; its output is above", file=sys.stderr, flush=True)
        return JobResult(code, first, how, r.node.node_id)

    def _stop(self, ranks: list[_Rank]) -> None:
        for r in ranks:
            if not r.lost:
                with suppress(Exception):
                    self.ray.get(r.agent.stop.remote(), timeout=30.0)
            self.ray.kill(r.agent)

    @contextmanager
    def _forwarding_signals(self) -> Iterator[None]:
        signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
        old = {s: signal.signal(s, self._on_signal) for s in signals}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Noted here, passed on by the watch loop (Ray calls do not belong in a handler)."""
        self.interrupted = True
        self._pending.append(signum)

    def _forward_pending(self, ranks: list[_Rank]) -> None:
        """Each signal to every rank: SIGUSR1 (preemption) or SIGUSR2 (Ctrl-C); the ranks finish
        the step and checkpoint on the first, stop at once on a second."""
        while self._pending:
            signum = self._pending.pop(0)
            to = signal.SIGUSR2 if signum == signal.SIGINT else signal.SIGUSR1
            if self._first_signal is None:
                self._first_signal = signum
                print(
                    f"megarl: {signal.Signals(signum).name} received: asking the {len(ranks)} "
                    "ranks to finish the current step and save a checkpoint (the same signal "
                    "again stops them at once)",
                    file=sys.stderr,
                    flush=True,
                )
            for r in ranks:
                if not r.lost:
                    r.agent.send_signal.remote(int(to))

    def close(self) -> None:
        if self.ray.is_initialized():
            self.ray.shutdown()


def _local_resources(world: int) -> dict[str, object]:
    """A local instance: one CPU per rank on a CPU (so exactly the job's ranks fit), this
    machine's GPUs and CPUs on a GPU machine; a small object store; no dashboard."""

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "address": "local",
        "num_cpus": max(world, os.cpu_count() or 1) if gpus else world,
        "num_gpus": gpus,
        "object_store_memory": LOCAL_OBJECT_STORE_BYTES,
        "include_dashboard": False,
    }


def _rank_base_env(spec: JobRequest, verbose: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
    env.update(rank_env(verbose))
    env.update(spec.env)
    # The ranks take SIGUSR1 (from this driver) as the preemption signal, SIGTERM as "stop now".
    env[LAUNCHER_ENV] = str(os.getpid())
    # this job's vLLM shared-memory segments (each node's agent removes them when it stops)
    env.setdefault(RUN_SEGMENTS_ENV, new_segment_prefix())
    return env


def _write(poll: Poll) -> None:
    for data, stream in ((poll.stdout, sys.stdout), (poll.stderr, sys.stderr)):
        if not data:
            continue
        buffer = getattr(stream, "buffer", None)
        if buffer is not None:
            buffer.write(data)
        else:
            stream.write(data.decode(errors="replace"))
        stream.flush()


def _cause_seen(ranks: list[_Rank], failed: list[int]) -> bool:
    """Whether a failed rank failed of its own (or lost its actor), or no rank is still running.

    The ranks are polled one by one: a rank polled just before it was killed reports itself
    running, while the ranks it left in a collective may report their own exit in the same poll.
    """
    if all(r.lost or (r.poll is not None and r.poll.exit_code is not None) for r in ranks):
        return True
    return any(ranks[i].lost or not is_consequence(_exit_of(ranks[i])[0]) for i in failed)


def _exit_of(rank: _Rank) -> tuple[int, float]:
    """A finished rank's exit code and time of exit."""
    assert rank.poll is not None and rank.poll.exit_code is not None
    return rank.poll.exit_code, rank.poll.ended_at or 0.0
