"""A training checkpoint's save needs no more host memory per rank as the data-parallel size
grows: each rank writes its own distributed-optimizer shard of the model-space optimizer state
(:mod:`megarl.run.optimizer_shards`) instead of first gathering its tensor-parallel shard's whole
state on every data-parallel rank (megatron's ``fully_reshardable`` save, what megarl did before).

The same random model (12M parameters, fp32) trained one Adam step and saved at DP2 and at DP4
(gloo): the peak resident memory each rank adds while it saves, sampled every 2 ms, is no larger
at DP4 than at DP2 (+ 16 MiB of allocator noise) and stays under half of what one gathered copy
of the optimizer state (weights, exp_avg, exp_avg_sq) takes (megatron's gather adds at least
one such copy on every rank, at both sizes). That these checkpoints load at other layouts is what
the resume tests check (tests/e2e/test_train.py).
"""

from __future__ import annotations

import pytest

from tests.config_dirs import qwen2_config_dir
from tests.distributed.checkpoint_memory_workers import save_memory_worker
from tests.mp import run_gloo

MIB = 1 << 20
NOISE = 16 * MIB


def _config_dir(root):
    return qwen2_config_dir(root, "qwen2-checkpoint", 16384, 256, 1024)


@pytest.mark.timeout(300)
def test_checkpoint_save_host_memory_per_rank_does_not_grow_with_dp(tmp_path):
    model_dir = str(_config_dir(tmp_path))
    added, gathered = {}, 0
    for dp in (2, 4):
        ranks = run_gloo(save_memory_worker, dp, model_dir, str(tmp_path / f"dp{dp}"))
        added[dp] = max(r["added"] for r in ranks)
        gathered = 3 * 4 * ranks[0]["params"]  # weights, exp_avg, exp_avg_sq (fp32), one copy
        print(f"DP{dp}: save added {[r['added'] // MIB for r in ranks]} MiB per rank")
    print(f"one gathered copy of the optimizer state: {gathered // MIB} MiB")
    assert added[4] <= added[2] + NOISE, added
    assert added[4] < gathered / 2, (added, gathered)
