"""vLLM's CPU worker names its TP shared-memory segments after its init method, ``env://`` on
every megarl run: megarl prefixes them with a per-run name, so that runs side by side on one
machine, or the leftovers of a killed run, never share a segment (measured before the fix: a
SIGKILLed TP2 run left ``/dev/shm/-tp:0-[0-1]-cpushm_0`` and every later TP2 engine on the
machine failed with "create shm in SHMManager failed. errno: 17")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.distributed.device_communicators import cpu_communicator

from megarl import shm_segments
from megarl.shm_segments import name_cpu_shm_segments_per_run


def test_segments_are_named_per_run_and_never_prefixed_twice(monkeypatch: pytest.MonkeyPatch):
    shm = cpu_communicator._CPUSHMDistributed
    monkeypatch.setattr(shm, "make_group_name", shm.__dict__["make_group_name"])  # restored after
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what vLLM's CPU worker sets from env://
    group = SimpleNamespace(unique_name="tp:0", ranks=[2, 3])
    assert shm.make_group_name(group) == "//-tp:0-[2-3]-cpushm"  # vLLM's own name: run-agnostic
    name_cpu_shm_segments_per_run("megarl-11-aaaa")
    assert shm.make_group_name(group) == "megarl-11-aaaa--tp:0-[2-3]-cpushm"
    name_cpu_shm_segments_per_run("megarl-12-bbbb")  # a second engine in the same process
    assert shm.make_group_name(group) == "megarl-12-bbbb--tp:0-[2-3]-cpushm"


def test_a_jobs_segments_are_removed_by_its_prefix_and_no_others(tmp_path, monkeypatch):
    """The launcher removes the segments of the job it ran, whatever its end, and leaves those of
    a job beside it alone."""
    monkeypatch.setattr(shm_segments, "_SHM", tmp_path)
    mine, other = shm_segments.new_segment_prefix(), "megarl-999-beside00"
    assert mine != shm_segments.new_segment_prefix()  # a fresh one for every job
    for prefix in (mine, other):
        (tmp_path / f"{prefix}--tp:0-[0-1]-cpushm_0").write_bytes(b"x")
    shm_segments.remove_run_segments(mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{other}--tp:0-[0-1]-cpushm_0"]
    shm_segments.remove_run_segments("")  # no prefix: nothing is removed
    assert len(list(tmp_path.iterdir())) == 1
