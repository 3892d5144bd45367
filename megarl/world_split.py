"""The job split into a trainer world and a rollout world (``rollout.placement.mode: async``).

Asynchronous training runs one SPMD program over the whole job (torchrun or Slurm start every
process the same way); the last ``parallel.rollout_ranks`` processes only generate, the others
only train. Each group gets a default process group of its own, over its own ranks, so that
everything built on the default group works unchanged inside each: megatron's model-parallel
groups over the trainers (megatron sizes its layout by the default group), vLLM's
``external_launcher`` groups over the rollout ranks (vLLM builds its TP groups with
``new_group`` over the default group, which every member of that group must enter).

The two worlds meet through *bridges*: process groups made for exactly their members (a source
trainer and the rollout ranks for weights, the rollout leader and the trainers for batches),
built directly on the job's rendezvous store so that no other process has to take part in their
creation. Rank math (:class:`WorldSplit`) is pure; :func:`init_split_world` creates the groups.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from megarl.loopback import rank_store

if TYPE_CHECKING:
    import torch.distributed as dist

TRAINER, ROLLOUT = "trainer", "rollout"


@dataclass(frozen=True)
class WorldSplit:
    """Ranks ``0 .. trainers - 1`` train; ranks ``trainers .. world_size - 1`` roll out."""

    world_size: int
    rollout_ranks: int

    def __post_init__(self) -> None:
        if not 0 < self.rollout_ranks < self.world_size:
            raise ValueError(
                f"a split world needs 1 .. {self.world_size - 1} rollout ranks of "
                f"{self.world_size}, got {self.rollout_ranks}"
            )

    @property
    def trainers(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def trainer_ranks(self) -> list[int]:
        return list(range(self.trainers))

    @property
    def rollout_global_ranks(self) -> list[int]:
        return list(range(self.trainers, self.world_size))

    @property
    def rollout_leader(self) -> int:
        """The rollout rank that sends the batches (its group's rank 0)."""
        return self.trainers

    def role(self, rank: int) -> str:
        self._check(rank)
        return TRAINER if rank < self.trainers else ROLLOUT

    def local_rank(self, rank: int) -> int:
        """The rank inside its own group's world."""
        self._check(rank)
        return rank if rank < self.trainers else rank - self.trainers

    def world_of(self, rank: int) -> int:
        """The size of the world ``rank`` belongs to."""
        return self.trainers if self.role(rank) == TRAINER else self.rollout_ranks

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the job's {self.world_size} ranks")


@dataclass
class SplitWorld:
    """This process in a split job: its global rank, the split and the job's store, from which
    bridges between the two worlds are made (:meth:`bridge`)."""

    split: WorldSplit
    rank: int
    store: dist.Store
    timeout: timedelta
    _made: set[str] = field(default_factory=set)

    @property
    def role(self) -> str:
        return self.split.role(self.rank)

    def bridge(self, name: str, members: Sequence[int], backend: str = "gloo") -> Bridge | None:
        """A process group of global ``members`` (in that order; the first is index 0) for this
        process, or None when it is not one of them. Only the members take part; every member
        must make it, with the same name and members. Names are single-use."""
        if name in self._made:
            raise ValueError(f"bridge {name!r} was made already")
        self._made.add(name)
        members = list(members)
        if len(set(members)) != len(members):
            raise ValueError(f"bridge {name!r}: repeated members {members}")
        if self.rank not in members:
            return None

        store = PrefixStore(f"megarl/bridge/{name}/", self.store)
        index = members.index(self.rank)
        backend_pg = make_backend(backend, store, index, len(members), self.timeout)
        return Bridge(name, members, index, backend_pg)


def make_backend(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta):
    """A gloo (CPU tensors) or NCCL (CUDA tensors) process group of its own ranks over
    ``store``, outside torch.distributed's registry of the default group's subgroups: it is
    used through its own methods (:class:`Bridge`)."""

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"unknown bridge backend {backend!r}; known: gloo, nccl")


class Bridge:
    """A process group between ranks of the two worlds; ``members[i]`` is its rank ``i``."""

    def __init__(self, name: str, members: Sequence[int], index: int, backend) -> None:
        self.name = name
        self.members = list(members)
        self.index = index
        self._pg = backend

    @property
    def size(self) -> int:
        return len(self.members)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """``tensor`` of member ``src`` into every member's ``tensor`` (contiguous, in place)."""

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._pg.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj: object = None, src: int = 0) -> object:
        """``obj`` of member ``src`` on every member (pickled; its size goes first)."""
        if self.index == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.broadcast(size, src)
        if self.index != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.broadcast(payload, src)
        return obj if self.index == src else pickle.loads(payload.numpy().tobytes())


def init_split_world(split: WorldSplit, backend: str, timeout: timedelta) -> SplitWorld:
    """Initialise this process's default group over its own role's ranks (from torchrun's or
    srun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). On a rollout rank RANK and
    WORLD_SIZE are set to its place in the rollout world afterwards, as vLLM's external launcher
    reads them; ``MEGARL_JOB_RANK`` keeps the job's."""

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != split.world_size:
        raise ValueError(f"the job has {world} processes, the split {split.world_size}")
    store = rank_store(rank, world, timeout)  # a one-machine job: rank 0's, on loopback
    if store is None:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    role = split.role(rank)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"megarl/{role}/", store),
        rank=split.local_rank(rank),
        world_size=split.world_of(rank),
        timeout=timeout,
    )
    os.environ["MEGARL_JOB_RANK"] = str(rank)
    os.environ["MEGARL_JOB_WORLD_SIZE"] = str(world)
    if role == ROLLOUT:
        os.environ["RANK"] = str(split.local_rank(rank))
        os.environ["WORLD_SIZE"] = str(split.world_of(rank))
    return SplitWorld(split, rank, store, timeout)


__all__ = ["ROLLOUT", "TRAINER", "SplitWorld", "WorldSplit", "init_split_world"]
