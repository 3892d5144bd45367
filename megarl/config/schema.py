"""The settings: one dataclass per section, one default per setting; the settings that take
one of a fixed set of words are ``Literal`` types, so OmegaConf refuses any other word when the
config loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from megarl.config.literals import (
    DistillMode,
    Dtype,
    NanPolicy,
    OldLogProbForward,
    OverlongPrompts,
    Recompute,
    ReshardMode,
    ResumeMode,
    RolloutBackend,
    RolloutMode,
    SleepLevel,
    TrainerKind,
    TransformerImpl,
    Truncation,
    TurnLoop,
    WandbMode,
)


@dataclass
class ModelConfig:
    path: str = MISSING  # local Hugging Face folder of the actor (and reference)
    critic_path: str | None = None  # PPO critic trunk; None: same as path
    # auto: bfloat16 on CUDA, float32 on CPU (megarl.gpu_defaults) | float32 | bfloat16
    dtype: Dtype = "auto"
    # Activation recomputation: none | selective (megatron's core-attention recompute) | full
    # (whole layers, recompute_num_layers per checkpoint)
    recompute: Recompute = "none"
    recompute_num_layers: int = 1
    # auto: Transformer Engine layers where CUDA and TE are present, else megatron's local spec
    transformer_impl: TransformerImpl = "auto"
    # Mixture-of-experts models only: router load-balancing loss and router z-loss coefficients
    # (0: off; RL keeps the policy objective alone by default)
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    pp_layers: list[int] | None = None  # uneven split over pipeline stages
    infer_tp: int | None = None  # vLLM tensor parallel size; None: same as tp
    # Megatron sequence parallelism (activations split along the sequence over the TP group);
    # None: on when tp > 1
    sequence_parallel: bool | None = None
    # Context parallel size (sequence split over GPUs in attention); needs Transformer Engine
    cp: int = 1
    # Expert parallel size (MoE models): each MoE layer's experts split over ep ranks taken from
    # the data-parallel ones; must divide dp and the number of experts
    ep: int = 1
    # rollout.mode=async: the last rollout_ranks processes run only the rollout engine (a
    # multiple of infer_tp); the others train, laid out tp x pp x dp. 0 in colocated mode.
    rollout_ranks: int = 0


@dataclass
class DataConfig:
    train_files: list[str] = MISSING
    val_files: list[str] = field(default_factory=list)
    train_batch_size: int = 1024  # prompts per step, global
    val_batch_size: int = 64
    max_prompt_length: int = 512
    overlong_prompts: OverlongPrompts = "filter"
    shuffle: bool = True
    seed: int = 1


@dataclass
class SamplingSettings:
    """``rollout.sampling``: what each request asks the engine for."""

    n: int = 5  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_length: int = 512
    # Every response runs to max_response_length: EOS is sampled like any other token and does
    # not stop it (fixed-length rollouts, e.g. so that a discount or a per-token KL penalty
    # cannot be gamed by stopping early; benchmarks). Training and validation alike. With
    # rollout.env every model turn runs to its token limit.
    ignore_eos: bool = False
    val_temperature: float = 0.0  # greedy validation
    val_n: int = 1  # samples per validation prompt (pass@k / mean@k over them); > 1 needs val_temperature > 0
    # true: every request carries its own seed (derived from trainer.seed and its global index),
    # so the samples do not depend on the layout, the engine count or the batching, and a resumed
    # run samples what the uninterrupted one would; false: one seed per engine and vLLM's batched
    # sampler (per-request seeds force its per-request sampling loop and turn its FlashInfer
    # top-k/top-p kernel off), at the price of both guarantees (docs/gpu_settings.md)
    per_request_seeds: bool = True


@dataclass
class EngineSettings:
    """``rollout.engine``: the rollout engine itself, its memory and how weights reach it."""

    backend: RolloutBackend = "vllm"  # hf: Hugging Face generate (no vLLM needed; for debugging)
    # The rollout engine's weights and compute: auto (model.dtype) | float32 | bfloat16. The
    # reshard casts the actor's weights to it, so e.g. a CPU whose bf16 decode is slow can train
    # in bf16 and sample in fp32.
    dtype: Dtype = "auto"
    kv_cache_gib: float = 1.0  # CPU vLLM KV cache per rank
    gpu_memory_utilization: float = 0.5  # CUDA vLLM: share of GPU memory for weights + KV cache
    max_num_seqs: int = 256  # sequences each vLLM engine decodes at once (its scheduler's cap)
    # CUDA rollout engine between rollouts: 2 discards its weights (the reshard refills every
    # one), 1 copies them to host memory and back; both free the KV cache
    sleep_level: SleepLevel = 2
    # How the actor's weights reach the rollout engine: shard (each rank receives only the
    # slices its rollout TP rank loads), full (whole tensors on every rank), auto (shard where
    # the backend can load slices of the model, else full). See docs/resharding.md.
    reshard_mode: ReshardMode = "auto"


@dataclass
class PlacementSettings:
    """``rollout.placement``: where the rollout runs against training, and how far behind."""

    # colocated: every rank rolls out, then trains. async: parallel.rollout_ranks ranks generate
    # while the others train (docs/async.md)
    mode: RolloutMode = "colocated"
    # async: the rollout runs at most this many policy versions (optimizer steps) behind the
    # weights it is trained with; 0 is on-policy (the colocated run's samples)
    max_staleness: int = 1
    # async: generation in flight when new weights arrive continues with them (each token
    # records its version); off: the new weights wait for the next batch
    partial: bool = False
    # async with partial: tokens generated between two checks for new weights
    partial_chunk_tokens: int = 64


@dataclass
class EnvironmentSettings:
    """``rollout.environment``: how the trajectories of ``rollout.env`` run (turns, tools,
    failures); the environment itself is chosen by ``rollout.env``."""

    max_turns: int = 4  # model turns per trajectory
    # continuous: each trajectory goes on as soon as its own environment answers (on vLLM its
    # next turn joins the running batch at the engine's next step; on hf the engine's next
    # call); lockstep: every turn of every trajectory in one call, the next after the turn's
    # slowest environment (repeatable bit for bit on vLLM)
    turn_loop: TurnLoop = "continuous"
    # New tokens of one model turn; None: rollout.sampling.max_response_length. A trajectory's
    # budget is its prompt + max_response_length tokens (all model turns and environment tokens
    # together).
    max_turn_tokens: int | None = None
    tool_concurrency: int = 8  # tool calls (and synchronous env steps) running at once per engine
    tool_timeout_s: float = 30.0  # a tool call past this gives the model an error result
    # Share of a step's samples whose environment (or agent) may fail (raise, break the API)
    # before the run stops with the first error; failed samples score 0 and are counted
    # (rollout/env_failures).
    max_env_failures: float = 0.5


@dataclass
class RolloutConfig:
    """The rollout, by concern: ``sampling``, ``engine``, ``placement`` and ``environment``
    sections, beside the choice of an environment or an agent. The flat keys of earlier configs
    (``rollout.n``, ``rollout.mode``, ``rollout.max_turns`` ...) still load: megarl.config.moved_keys
    moves them into their sections."""

    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    environment: EnvironmentSettings = field(default_factory=EnvironmentSettings)
    # Multi-turn rollouts (docs/environments.md): an Environment subclass, "module:Class" or
    # "path/to/file.py:Class", built once per sample with env_kwargs. None: single-turn.
    env: str | None = None
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    # A black-box agent behind an OpenAI-compatible endpoint (docs/agents.md): "path/to/file.py:NAME"
    # naming NAME(row, base_url, model) -> float | None, sync or async, run once per sample and
    # trained on like an environment's trajectories (colocated). None: no agent.
    agent: str | None = None
    agent_concurrency: int = 8  # agents running at once per rollout rank
    agent_timeout_s: float = 300.0  # one sample's agent past this gets reward 0 (counted)


@dataclass
class DistillConfig:
    """On-policy distillation: a frozen teacher scores the student's own rollouts and the
    per-token reverse KL (student logprob - teacher logprob) steers the student."""

    teacher_path: str | None = (
        None  # Hugging Face folder of the teacher (same tokenizer); None: off
    )
    # Weight of the reverse KL. mode=reward: a dense reward, each response token's advantage gets
    # -coef * its own KL (beside the outcome advantages); mode=loss: coef * a KL term in the
    # actor loss whose gradient is the reverse KL's (k2 estimator).
    coef: float = 1.0
    mode: DistillMode = "reward"


@dataclass
class AlgorithmConfig:
    """Algorithm choices by registered name (megarl/algos). Settings left None take the chosen
    function's own default; a setting given for a function that does not take it is an error."""

    adv_estimator: str = "grpo"  # gae | grpo | rloo | reinforce_plus_plus | any registered
    policy_loss: str = "ppo_clip"  # ppo_clip | gspo | any registered
    loss_agg_mode: str = "token-mean"
    # Parameters of the chosen functions. Named ones; None: the function's default.
    clip_ratio_low: float | None = None  # ppo_clip, gspo
    clip_ratio_high: float | None = None  # ppo_clip, gspo (DAPO's clip-higher: > clip_ratio_low)
    clip_ratio_c: float | None = None  # ppo_clip's dual-clip bound for negative advantages
    gamma: float | None = None  # gae, reinforce_plus_plus
    lam: float | None = None  # gae
    norm_adv_by_std: bool | None = None  # grpo (False: Dr. GRPO)
    # Any other keyword parameter of the chosen policy loss / advantage estimator, by its name,
    # e.g. {clip_ratio_c: null} turns ppo_clip's dual clip off, {whiten: false} for gae.
    policy_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    adv_estimator_kwargs: dict[str, Any] = field(default_factory=dict)
    # seq-mean-token-sum-norm (Dr. GRPO): the constant each sequence's token sum is divided by;
    # None: rollout.max_response_length.
    loss_agg_norm_length: int | None = None
    entropy_coef: float = 0.0
    use_kl_loss: bool = True  # GRPO: KL to the reference as a loss term
    kl_loss_coef: float = 0.001
    kl_loss_estimator: str = "k3"
    use_kl_in_reward: bool = False  # PPO: KL penalty in the reward
    kl_in_reward_estimator: str = "k1"
    kl_ctrl: str = "adaptive"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.02
    kl_horizon: int = 10000
    # Off-policy correction of the rollout's samples (megarl/algos/rollout_correction.py):
    # none | token_tis | seq_tis | masked_is | icepop | decoupled_ppo | any registered, with its
    # settings by name in rollout_correction_kwargs (e.g. {cap: 2.0} for token_tis)
    rollout_correction: str = "none"
    rollout_correction_kwargs: dict[str, Any] = field(default_factory=dict)
    # DAPO dynamic sampling: drop prompt groups whose rewards are all equal (no advantage signal)
    # and draw further batches, at most filter_groups_max_batches per step, until the step's
    # data.train_batch_size prompts are filled (else the step trains on the groups it kept, cut
    # to a multiple of the DP size), the same groups at any layout (trainer/group_selection.py).
    filter_groups: bool = False
    filter_groups_max_batches: int = 4
    # On-policy distillation from a frozen teacher (megarl.trainer.distill); off without a path.
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    lr_decay_style: str = "constant"
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_eps: float = 1e-8


@dataclass
class LoraConfig:
    """LoRA adapters on the actor (megarl.models.lora); the critic always trains every weight."""

    rank: int = 0  # 0: off (every actor weight trains)
    alpha: float = 16.0  # adapters scale by alpha / rank, as peft's
    dropout: float = 0.0  # on the adapters' input, in training passes only
    # "all-linear" or HF projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    # down_proj) and/or megatron modules (linear_qkv, linear_proj, linear_fc1, linear_fc2)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 256  # prompts per mini-batch, global
    ppo_epochs: int = 1
    micro_batch_size: int = 4  # sequences per micro-batch per rank
    max_tokens_per_micro_batch: int | None = None  # token budget instead of a count
    # Sequence packing (remove padding): each micro-batch runs as one row of its sequences end to
    # end, attention and positions per sequence, in every forward and backward of the actor,
    # reference, critic and reward model; the budget above then counts real tokens.
    packing: bool = True
    # With packing: each distinct prompt of a micro-batch goes through the model once, its
    # samples' responses after it, each attending to the prompt and to itself only (the same
    # maths as one sequence per sample, float rounding aside; megarl.models.shared_prompts).
    # Micro-batches then keep each prompt's samples together. Needs rope and megarl's SDPA
    # attention (the CPU layer spec), not Transformer Engine.
    share_prompts: bool = False
    # After the rollout, whole prompt groups are re-dealt over the data-parallel ranks so each
    # trains about the same tokens (perf/dp_token_imbalance; as drawn: ..._rollout).
    balance_dp_tokens: bool = True
    # Share of the actor's optimizer states (and Adam's step) held and run on the host instead
    # of the GPU (megatron's optimizer CPU offload); 0: none. CUDA only.
    optimizer_offload: float = 0.0
    # The actor's weights, grads and optimizer states in host memory during the rollout's
    # generation (after the reshard into the rollout engine, back before the actor scores it).
    param_offload: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    # The old logprobs of the policy ratio. auto: when each batch gets exactly one optimizer step
    # (megarl.trainer.old_log_probs lists the conditions) they are the update's own logprobs,
    # detached, and the separate forward that scores the rollout with the actor is skipped (the
    # rollout-vs-trainer mismatch metrics then come from the update's forward); always: that
    # separate forward runs every step.
    old_log_prob_forward: OldLogProbForward = "auto"
    # Mixture-of-experts: the trainer's routers use the experts the rollout engine chose for each
    # token (routing replay, "R3") in the old-logprob, reference and update forwards. Whether on
    # or off, an MoE run on the HF rollout backend records the rollout's routing and logs
    # moe/routing_agreement and moe/router_agreement every step (docs/training.md).
    router_replay: bool = False


@dataclass
class CriticConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    cliprange_value: float = 0.5
    ppo_epochs: int = 1
    # The critic's weights, grads and optimizer states in host memory while the rollout runs.
    param_offload: bool = False


@dataclass
class RefConfig:
    # The reference model's weights in host memory while the rollout runs.
    param_offload: bool = False


@dataclass
class OverlongBufferConfig:
    len: int = 0  # tokens; 0: off
    penalty_factor: float = 1.0


@dataclass
class JudgeConfig:
    """A generative judge (docs/rewards.md): a causal LM reads ``template`` filled with a sample
    and answers; the last match of ``score_pattern`` in its answer (its first group, a number)
    is the sample's score, + ``weight`` * it. An answer without a number counts as a failed
    sample (reward.max_failed_fraction)."""

    # Judged here: an HF causal-LM folder, generated greedily with transformers on each rank
    # (colocated; on a GPU its weights wait in host memory between scorings)
    model_path: str | None = None
    # Or judged at an OpenAI-compatible server (its base URL, e.g. http://host:8000/v1), with
    # `model` as the model name; the API key from the environment variable `api_key_env`
    url: str | None = None
    model: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    # {prompt} (the row's last user message), {response}, {ground_truth}; {{ }} for braces
    template: str = (
        "Rate the response to the question from 0 to 10.\n\nQuestion: {prompt}\n\n"
        "Response: {response}\n\nEnd your answer with 'Score: N'."
    )
    score_pattern: str = r"Score:\s*(-?\d+(?:\.\d+)?)"
    weight: float = 1.0
    max_tokens: int = 64  # the judge's answer, at most
    max_length: int = 2048  # tokens of a local judge's prompt + answer; longer prompts fail
    concurrency: int = 8  # a URL's requests in flight at once, per rank
    timeout_s: float = 60.0  # per request to a URL
    retries: int = 3  # a URL's connection errors, 429 and 5xx


@dataclass
class RewardConfig:
    custom_fn: str | None = None  # "module:function" or "path.py:function"
    num_workers: int = 0
    timeout_s: float = 30.0
    strict: bool = False
    # A step (or validation batch) where more than this share of the samples fail to score (the
    # scorer raises, times out, or returns NaN/inf) stops the run with the first error; 1.0: never
    max_failed_fraction: float = 0.5
    # A reward model scoring prompt + response: an HF *ForSequenceClassification folder (e.g. one
    # exported from `megarl train-rm`) or a megarl reward-model checkpoint; same tokenizer as the
    # policy. Score = rule_weight * rule score + model_weight * reward-model score; rule_weight 0
    # skips the rule scorers.
    model_path: str | None = None
    rule_weight: float = 1.0
    model_weight: float = 1.0
    # A remote reward service (docs/rewards.md): each rank POSTs its samples in batches as JSON
    # {"samples": [...]} and reads {"scores": [...]}; + remote_weight * its score. A batch whose
    # request fails (after remote_retries retries of connection errors, 5xx and 429), times out
    # or is answered badly counts each of its samples as failed (max_failed_fraction).
    remote_url: str | None = None
    remote_weight: float = 1.0
    remote_batch_size: int = 64  # samples per request
    remote_concurrency: int = 8  # requests in flight at once, per rank
    remote_timeout_s: float = 60.0  # per request
    remote_retries: int = 3
    remote_backoff_s: float = 0.5  # the first retry's wait, doubled for each next one
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    # DAPO overlong reward shaping: responses longer than rollout.max_response_length - len get
    # a penalty rising linearly to -penalty_factor at max_response_length.
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class RewardModelConfig:
    """`trainer.kind: reward_model` (``megarl train-rm``): Bradley-Terry training on preference
    pairs. data.train_files / val_files hold prompt/chosen/rejected; data.train_batch_size and
    val_batch_size count pairs (global)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    micro_batch_size: int = 4  # pairs per micro-batch per rank (chosen + rejected together)
    max_length: int = 1024  # tokens of prompt + the longer response
    truncation: Truncation = "filter"
    margin: float = 0.0  # -log sigmoid(r_chosen - r_rejected - margin)


@dataclass
class SFTConfig:
    """`trainer.kind: sft` (``megarl train-sft``): supervised fine-tuning. data.train_files /
    val_files hold `prompt` + `response` rows or `messages` conversations; data.train_batch_size
    and val_batch_size count sequences (global). The loss is the token-mean NLL of the response
    (assistant) tokens over the whole batch."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    micro_batch_size: int = 4  # sequences per micro-batch per rank
    max_tokens_per_micro_batch: int | None = None  # token budget instead of a count
    packing: bool = True  # each micro-batch as one pack of its sequences (no padding)
    max_length: int = 1024  # tokens of prompt + response
    truncation: Truncation = "filter"  # truncate: cuts the response's end


@dataclass
class DPOConfig:
    """`trainer.kind: dpo` (``megarl train-dpo``): direct preference optimisation on
    prompt/chosen/rejected pairs against a frozen reference. data.train_batch_size and
    val_batch_size count pairs (global)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    loss: str = (
        "sigmoid"  # a registered DPO loss: sigmoid | ipo | hinge | robust | ... (megarl.algos.dpo)
    )
    beta: float = 0.1
    loss_kwargs: dict[str, Any] = field(default_factory=dict)  # other parameters of the loss
    # The frozen reference policy; None: model.path (with actor.lora: the actor's own base).
    # Reference-free losses (simpo) build none.
    reference_path: str | None = None
    micro_batch_size: int = 4  # pairs per micro-batch per rank (chosen + rejected together)
    packing: bool = True
    max_length: int = 1024  # tokens of prompt + the longer response
    truncation: Truncation = "filter"


@dataclass
class ElasticConfig:
    """Elastic recovery (``megarl train`` as the launcher: torchrun's, Ray's or Slurm's path):
    when a rank dies, the job restarts by itself from its latest intact checkpoint on the ranks
    still available; see docs/elastic.md for what it promises."""

    max_restarts: int = 0  # 0: off (a failed rank ends the job)
    min_world_size: int = 1  # never restart on fewer ranks than this
    # How long a restart waits for lost resources to come back (e.g. a replacement node joining
    # the Ray cluster) before going on with fewer ranks
    wait_s: float = 30.0


@dataclass
class TrainerConfig:
    # policy (PPO/GRPO) | reward_model (Bradley-Terry) | sft | dpo
    kind: TrainerKind = "policy"
    total_steps: int = 100
    save_freq: int = 0  # 0: only at the end (verl's -1, never, is read as 0)
    test_freq: int = 0  # 0 (or verl's -1): never; validation runs over the whole data.val_files
    # validate once before the first step (policy runs; the reward-model, SFT and DPO trainers,
    # whose validation is a forward pass, always do when validation is on)
    val_before_train: bool = False
    val_pass_score: float = 1.0  # a validation sample "passes" (pass@k) when it scores >= this
    output_dir: str = "outputs/run"
    resume: ResumeMode = "auto"
    # A fresh run in an output_dir holding an earlier run's checkpoints or metrics is refused
    # unless this is true: then the earlier run's folder is renamed to OUT.old-<time> (never deleted)
    overwrite: bool = False
    seed: int = 1
    nan_policy: NanPolicy = "stop"
    # Where metrics go, besides OUTPUT/metrics.jsonl: any of console, mlflow, tensorboard, wandb.
    loggers: list[str] = field(default_factory=lambda: ["console", "mlflow"])
    mlflow_tracking_uri: str | None = None  # None: sqlite:///./mlflow.db; "none": MLflow off
    experiment: str = "megarl"
    run_name: str | None = None
    wandb_mode: WandbMode | None = None  # None: WANDB_MODE, else online
    profile_steps: list[int] = field(default_factory=list)
    keep_last: int = 2  # newest checkpoints kept; older ones are removed once a newer is complete
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this; 0: none
    # OUTPUT/rollouts/step_N_dpD.jsonl each step: every sample's token ids, response mask,
    # logprobs, advantages and text (megarl/trainer/rollout_dump.py)
    dump_rollouts: bool = False
    # A step phase (rollout, reward, update, save ...) without progress for this long: every rank
    # prints its stacks and the job stops; torch.distributed collective timeouts derive from it.
    hang_timeout_s: float = 1800.0
    elastic: ElasticConfig = field(default_factory=ElasticConfig)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
