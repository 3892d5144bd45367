"""What a run asks of the machine: sequence and batch sizes, algorithm, rollout settings."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.errors import ConfigError

ALGOS = ("grpo", "ppo")


@dataclass(frozen=True)
class Workload:
    """One optimizer step of an RLHF run, as the planner sees it.

    ``global_batch`` sequences (prompt + response, ``seq_len`` tokens each) make one optimizer
    step; each DP rank runs ``micro_batches(dp)`` micro-batches of ``micro_batch`` sequences.
    The rollout generates the same sequences: ``response_len`` new tokens each, at most
    ``rollout_seqs`` at a time per vLLM engine.
    """

    seq_len: int = 4096
    micro_batch: int = 1
    global_batch: int = 256
    algo: str = "grpo"
    reference: bool = True  # a KL term needs the frozen reference model
    rollout: bool = True  # model the colocated vLLM phase (off: training only)
    response_len: int | None = None  # None: half of seq_len
    rollout_seqs: int = 64  # concurrent sequences per vLLM engine the KV cache must hold
    gpu_memory_utilization: float | None = None  # vLLM's fraction mode instead of rollout_seqs
    # mean real tokens per sequence (prompt + response); with packing (actor.packing) the models
    # compute on these only. None: every sequence is seq_len long (packing gains nothing).
    mean_seq_len: int | None = None
    # actor.lora.rank (all-linear): only adapters train and sit in the optimizer, and the KL's
    # reference is the actor's own base (no reference copy); 0: full fine-tuning
    lora_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "global_batch", "rollout_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be a positive integer, got {value!r}"
                )
        if self.algo not in ALGOS:
            raise ConfigError(
                f"--algo {self.algo!r} is not known; choose one of {', '.join(ALGOS)}"
            )
        if self.response_len is not None and not 0 < self.response_len < self.seq_len:
            raise ConfigError(
                f"--response-len {self.response_len} must be between 1 and --seq-len - 1 "
                f"({self.seq_len - 1}): a sequence is prompt + response"
            )
        m = self.mean_seq_len
        if m is not None and not 0 < m <= self.seq_len:
            raise ConfigError(
                f"--mean-seq-len {m} must be between 1 and --seq-len ({self.seq_len}): the mean "
                "real length of a sequence (prompt + response)"
            )
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ConfigError(f"--lora-rank must be >= 0 (0: no LoRA), got {self.lora_rank!r}")
        u = self.gpu_memory_utilization
        if u is not None and not 0.0 < u < 1.0:
            raise ConfigError(
                f"--gpu-memory-utilization {u} must be a fraction between 0 and 1 (e.g. 0.6)"
            )

    @property
    def critic(self) -> bool:
        return self.algo == "ppo"

    @property
    def response_tokens(self) -> int:
        return self.response_len if self.response_len is not None else self.seq_len // 2

    def tokens_per_sequence(self, packing: bool) -> int:
        """Tokens the models compute per sequence: its mean real length when packed, the padded
        length (``seq_len``) otherwise."""
        if packing and self.mean_seq_len is not None:
            return self.mean_seq_len
        return self.seq_len

    def micro_batches(self, dp: int) -> int:
        """Micro-batches per DP rank per optimizer step (rounded up)."""
        return max(1, math.ceil(self.global_batch / (dp * self.micro_batch)))
