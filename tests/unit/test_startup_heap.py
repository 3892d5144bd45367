"""A rank imports its libraries without automatic garbage collection and runs its program with
them frozen and collection back on (megarl.startup_heap); vLLM's engine starts the same way.
Each in a fresh interpreter, as a rank starts: a frozen heap would outlive a test in pytest's."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.startup_heap import CollectionPaused
from tests.assets import tiny_llama_dir

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_pause_ends_with_the_block_or_resume_and_keeps_collection_off_if_it_was():
    assert gc.isenabled()
    with CollectionPaused() as paused:
        assert not gc.isenabled()
        paused.resume()
        assert gc.isenabled()
        paused.resume()  # a second call changes nothing
    assert gc.isenabled()
    with pytest.raises(RuntimeError), CollectionPaused():
        raise RuntimeError("a failed start-up")
    assert gc.isenabled()
    gc.disable()
    try:
        with CollectionPaused() as paused:
            paused.resume()
        assert not gc.isenabled()  # off before: stays off
    finally:
        gc.enable()


# the rank's entry point, with the program replaced by one that records the collector's state
RANK = """
import gc, json, sys
import megarl.entry as entry

seen = {"frozen_at_start": gc.get_freeze_count()}

def trainer(cfg):
    seen["running"] = [gc.isenabled(), gc.get_freeze_count()]

def program(cfg):  # the rank imports the program and its libraries here
    seen["importing"] = gc.isenabled()
    return trainer

entry.program = program
seen["exit"] = entry.main(sys.argv[1:])
seen["after"] = gc.isenabled()
print(json.dumps(seen))
"""


def test_the_rank_imports_without_collection_and_runs_with_the_heap_frozen(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  path: /m\ndata:\n  train_files: [/d.parquet]\n")
    seen = _run(RANK, str(config), f"trainer.output_dir={tmp_path / 'out'}")
    assert seen["exit"] == 0 and seen["frozen_at_start"] == 0
    assert seen["importing"] is False
    enabled, frozen = seen["running"]
    assert enabled is True and frozen > 10_000  # megarl, torch and the config reader at least
    assert seen["after"] is True


@pytest.mark.parametrize("argv", [[], ["/no/such/config.yaml"]])
def test_a_rank_that_stops_before_its_program_collects_again(argv):
    seen = _run(RANK, *argv)
    assert seen["exit"] == 2 and "importing" not in seen and "running" not in seen
    assert seen["after"] is True


ENGINE = """
import gc, json, sys, types

seen = {}

class LLM:  # vLLM's engine class, recording the collector's state as the engine starts
    def __init__(self, **kwargs):
        seen["engine_start"] = [gc.isenabled(), gc.get_freeze_count()]

sys.modules["vllm"] = types.ModuleType("vllm")
sys.modules["vllm"].LLM = LLM
from megarl.rollout.rollout_types import EngineConfig
from megarl.rollout.vllm_rollout import VLLMRollout

seen["frozen_before"] = gc.get_freeze_count()
VLLMRollout(sys.argv[1], 1, EngineConfig(load_format="dummy"))
seen["after"] = gc.isenabled()
print(json.dumps(seen))
"""


def test_vllm_starts_without_collection_with_its_modules_frozen():
    seen = _run(ENGINE, str(tiny_llama_dir()))
    enabled, frozen = seen["engine_start"]
    assert enabled is False
    assert seen["frozen_before"] == 0 and frozen > 10_000  # torch's objects, vLLM's once real
    assert seen["after"] is True
