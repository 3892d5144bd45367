"""``MEGARL_SMOKE=1``: the settings under which ``scripts/run_qwen7b_grpo.sh`` runs a GPU recipe at
smoke size (a tiny random model, 2 steps), on a CPU or on a GPU node.

The recipe's algorithm and recompute setting stay; the sizes, the layout and what the machine
cannot run change:

- on a CPU: fp32 (``model.dtype=float32``: the CPU's dtype), 4 local ranks at TP1 x PP2 x DP2 with
  vLLM at TP2, a small CPU KV cache;
- on a GPU node: the GPU defaults (bf16, Transformer Engine where installed: fp32 would be
  refused there with packing, ``megarl.gpu_defaults.check_for_target``), as many ranks as there
  are GPUs up to 4 (4: as on the CPU; 2 or 3: two ranks; 1: one), vLLM's share of each GPU
  small (the tiny model needs little);
- both: no optimizer offload (a recipe's offload needs CUDA and Transformer Engine, and the smoke
  run is about the step, not the host); a config with expert parallelism runs a tiny Qwen3-MoE
  at EP2 (where two data-parallel ranks exist) rolled out by the Hugging Face backend (vLLM's CPU
  build cannot reload MoE weights in place, and vLLM's CUDA MoE reload has not run at tiny
  shapes here).

``python -m megarl.tools.smoke CONFIG`` prints the number of local ranks, the config's
``parallel.ep`` and then one override per line, for the script.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SmokeMachine:
    cuda: bool
    gpus: int = 0


def smoke_ranks(machine: SmokeMachine) -> int:
    """Local ranks of the smoke run."""
    if not machine.cuda:
        return 4
    return 4 if machine.gpus >= 4 else 2 if machine.gpus >= 2 else 1


def _layout(ranks: int, ep: int) -> list[str]:
    """TP1 x PP2 x DP(ranks / 2) with vLLM TP2 where 2+ ranks; an MoE config's experts over EP2
    where there are two data-parallel ranks (on 2 ranks: PP1 x DP2)."""
    if ranks == 1:
        return ["parallel.tp=1", "parallel.pp=1", "parallel.infer_tp=1", "parallel.ep=1"]
    if ep > 1 and ranks == 2:
        return ["parallel.tp=1", "parallel.pp=1", "parallel.infer_tp=2", "parallel.ep=2"]
    out = ["parallel.tp=1", "parallel.pp=2", "parallel.infer_tp=2"]
    if ep > 1:
        out.append("parallel.ep=2")
    return out


def smoke_overrides(machine: SmokeMachine, ep: int) -> list[str]:
    """The overrides of a smoke run of a recipe whose ``parallel.ep`` is ``ep`` (module doc)."""
    ranks = smoke_ranks(machine)
    out = ["model.dtype=float32"] if not machine.cuda else []
    out += _layout(ranks, ep)
    out += [
        "data.train_batch_size=4",
        "data.val_batch_size=4",
        "data.max_prompt_length=1024",  # one token per character with the tiny model's tokenizer
        "rollout.sampling.n=4",
        "rollout.sampling.max_response_length=16",
        "actor.ppo_mini_batch_size=2",
        "actor.max_tokens_per_micro_batch=1400",
        "actor.optimizer_offload=0",
        "trainer.total_steps=2",
        "trainer.save_freq=0",
        "trainer.test_freq=2",
        "trainer.experiment=smoke",
    ]
    out.append(
        "rollout.engine.gpu_memory_utilization=0.2"
        if machine.cuda
        else "rollout.engine.kv_cache_gib=0.0625"
    )
    if ep > 1:
        out.append("rollout.engine.backend=hf")
    return out


def this_machine() -> SmokeMachine:
    import torch

    cuda = torch.cuda.is_available()
    return SmokeMachine(cuda, torch.cuda.device_count() if cuda else 0)


def main(argv: Sequence[str]) -> int:
    from megarl.config import load_config

    if len(argv) != 1:
        print("usage: python -m megarl.tools.smoke CONFIG", file=sys.stderr)
        return 2
    ep = load_config(argv[0]).parallel.ep
    machine = this_machine()
    print(smoke_ranks(machine))
    print(ep)
    for override in smoke_overrides(machine, ep):
        print(override)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
