"""What a run asks of the machine: sequence and batch sizes, algorithm, rollout settings."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.errors import ConfigError
from megarl.models.dims import ModelDims

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
    # actor.max_tokens_per_micro_batch: a micro-batch holds at most this many tokens (at least one
    # whole sequence) instead of ``micro_batch`` sequences; the update and the scoring pass alike
    micro_batch_tokens: int | None = None
    # positions per sequence the output layer projects (megarl's trainer: the response's); None:
    # every position
    output_positions: int | None = None
    # the rollout is scored (old / reference logprobs, values) in a forward pass after vLLM sleeps,
    # in the update's micro-batches
    scoring: bool = True
    temperature: float = (
        1.0  # rollout.sampling.temperature: scoring divides the logits by it (a copy)
    )
    samples_per_prompt: int = 1  # rollout.sampling.n
    # sequences of one rollout step (all ranks; data.train_batch_size x n); None: global_batch
    rollout_batch: int | None = None
    sleep_level: int = (
        2  # rollout.engine.sleep_level: 1 keeps vLLM's weights in host memory meanwhile
    )
    reward_model: ModelDims | None = None  # reward.model_path's shape: its weights stay resident
    # reward.judge.model_path's shape: a whole replica per rank, on the device while it judges
    # (the scoring phase) and in host memory otherwise; judge_len: its prompt + answer tokens
    judge: ModelDims | None = None
    judge_len: int = 0
    # an MoE policy whose rollout records each token's experts (megarl.models.router_replay):
    # int16 ids per token, MoE layer and top-k slot, for the rank's rollout, in host memory
    record_routes: bool = False
    routes_gathered: bool = False  # actor.balance_dp_tokens: every rank's routes on each rank

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
        t = self.micro_batch_tokens
        if t is not None and (not isinstance(t, int) or t < 1):
            raise ConfigError(f"--tokens-per-micro-batch must be a positive integer, got {t!r}")
        if self.global_batch % self.samples_per_prompt:
            raise ConfigError(
                f"--global-batch {self.global_batch} is not a multiple of --n "
                f"{self.samples_per_prompt}: an optimizer step takes whole prompt groups"
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

    @property
    def rollout_sequences(self) -> int:
        return self.rollout_batch if self.rollout_batch is not None else self.global_batch

    @property
    def logits_rows_per_sequence(self) -> int:
        """Positions per sequence the output layer projects."""
        return self.output_positions if self.output_positions is not None else self.seq_len

    def micro_batch_shape(self, packing: bool) -> tuple[int, int]:
        """(rows, tokens per row) the layers see in one micro-batch: ``micro_batch`` sequences of
        their (packed: mean) length, or under a token budget one pack of it (padded: as many
        whole sequences as fit); a sequence longer than the budget still runs alone."""
        if self.micro_batch_tokens is None:
            return self.micro_batch, self.tokens_per_sequence(packing)
        tokens = max(self.micro_batch_tokens, self.seq_len)
        if packing:
            return 1, tokens
        return max(1, tokens // self.seq_len), self.seq_len

    def logits_rows(self) -> int:
        """Output positions of one micro-batch: its sequences' projected positions, or under a
        token budget at most the budget's tokens (sorted micro-batches of similar lengths hold
        about budget / length sequences, each projecting at most its length)."""
        if self.micro_batch_tokens is not None:
            return max(self.micro_batch_tokens, self.seq_len)
        return self.micro_batch * self.logits_rows_per_sequence

    def micro_batches(self, dp: int) -> int:
        """Micro-batches per DP rank per optimizer step (rounded up)."""
        if self.micro_batch_tokens is not None:
            tokens = self.global_batch * (self.mean_seq_len or self.seq_len)
            return max(1, math.ceil(tokens / (dp * self.micro_batch_tokens)))
        return max(1, math.ceil(self.global_batch / (dp * self.micro_batch)))
