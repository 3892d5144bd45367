"""The typed run configuration: one dataclass per section, one default per setting.

A run is a YAML file plus dotted overrides (``actor.optim.lr=1e-6``), merged onto these
dataclasses by OmegaConf. Unknown keys (named in full, with megarl's key for verl's: see
:mod:`megarl.config_keys`), wrong types and inconsistent batch sizes are :class:`ConfigError` s
that name the setting and the fix, raised before any model or process starts.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from megarl.config_keys import prepare_layer, unknown_keys_error
from megarl.errors import ConfigError
from megarl.lora_settings import check_lora_settings

# The settings that take one of a fixed set of words: OmegaConf refuses any other value when the
# config loads (load_config names the valid ones), and validate() checks a config built in code.
# Words chosen through a registry (algorithm.*, dpo.loss) are checked by megarl.algos.choices.
Dtype = Literal["auto", "float32", "bfloat16"]
Recompute = Literal["none", "selective", "full"]
TransformerImpl = Literal["auto", "local", "transformer_engine"]
OverlongPrompts = Literal["filter", "error"]
RolloutBackend = Literal["vllm", "hf"]
SleepLevel = Literal[1, 2]
ReshardMode = Literal["auto", "shard", "full"]
RolloutMode = Literal["colocated", "async"]
DistillMode = Literal["reward", "loss"]
OldLogProbForward = Literal["auto", "always"]
Truncation = Literal["error", "filter", "truncate"]
TrainerKind = Literal["policy", "reward_model", "sft", "dpo"]
ResumeMode = Literal["auto", "never"]
NanPolicy = Literal["stop", "skip"]
WandbMode = Literal["online", "offline", "disabled"]


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
class RolloutConfig:
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
    kv_cache_gib: float = 1.0  # CPU vLLM KV cache per rank
    # The rollout engine's weights and compute: auto (model.dtype) | float32 | bfloat16. The
    # reshard casts the actor's weights to it, so e.g. a CPU whose bf16 decode is slow can train
    # in bf16 and sample in fp32.
    dtype: Dtype = "auto"
    backend: RolloutBackend = "vllm"  # hf: Hugging Face generate (no vLLM needed; for debugging)
    gpu_memory_utilization: float = 0.5  # CUDA vLLM: share of GPU memory for weights + KV cache
    max_num_seqs: int = 256  # sequences each vLLM engine decodes at once (its scheduler's cap)
    # true: every request carries its own seed (derived from trainer.seed and its global index),
    # so the samples do not depend on the layout, the engine count or the batching, and a resumed
    # run samples what the uninterrupted one would; false: one seed per engine and vLLM's batched
    # sampler (per-request seeds force its per-request sampling loop and turn its FlashInfer
    # top-k/top-p kernel off), at the price of both guarantees (docs/gpu_settings.md)
    per_request_seeds: bool = True
    # CUDA rollout engine between rollouts: 2 discards its weights (the reshard refills every
    # one), 1 copies them to host memory and back; both free the KV cache
    sleep_level: SleepLevel = 2
    # How the actor's weights reach the rollout engine: shard (each rank receives only the
    # slices its rollout TP rank loads), full (whole tensors on every rank), auto (shard where
    # the backend can load slices of the model, else full). See docs/resharding.md.
    reshard_mode: ReshardMode = "auto"
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
    # Multi-turn rollouts (docs/environments.md): an Environment subclass, "module:Class" or
    # "path/to/file.py:Class", built once per sample with env_kwargs. None: single-turn.
    env: str | None = None
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4  # model turns per trajectory
    # New tokens of one model turn; None: max_response_length. A trajectory's budget is its
    # prompt + max_response_length tokens (all model turns and environment tokens together).
    max_turn_tokens: int | None = None
    tool_concurrency: int = 8  # tool calls (and synchronous env steps) running at once per engine
    tool_timeout_s: float = 30.0  # a tool call past this gives the model an error result
    # Share of a step's samples whose environment may fail (raise, break the API) before the run
    # stops with the first error; failed samples score 0 and are counted (rollout/env_failures).
    max_env_failures: float = 0.5


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
    # data.train_batch_size prompts are filled (else the step trains on the groups it kept).
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
    save_freq: int = 0  # 0: only at the end
    test_freq: int = 0  # 0: never; validation runs over the whole data.val_files
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


def _literal_words(hint: object) -> tuple[object, ...]:
    """The words of a ``Literal`` field type (``Literal[...] | None`` too); () for other types."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(w for arg in typing.get_args(hint) for w in _literal_words(arg))
    return ()


def _choice_fields(section: type, prefix: str = "") -> dict[str, tuple[object, ...]]:
    """Dotted key -> valid words of every ``Literal`` field under ``section``, nested ones too."""
    out: dict[str, tuple[object, ...]] = {}
    hints = typing.get_type_hints(section)
    for f in dataclasses.fields(section):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out.update(_choice_fields(cast(type, hint), f"{prefix}{f.name}."))
        elif words := _literal_words(hint):
            out[f"{prefix}{f.name}"] = words
    return out


def choices(key: str) -> tuple[object, ...]:
    """The valid words of the setting ``key`` (e.g. ``"model.dtype"``), read from its field type."""
    return _choice_fields(RunConfig)[key]


def _check_choices(cfg: RunConfig) -> None:
    for key, allowed in _choice_fields(RunConfig).items():
        value: object = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value is not None and value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Merge YAML + ``key=value`` overrides onto the defaults; validate; return a RunConfig."""
    schema = OmegaConf.structured(RunConfig)
    layers = []
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {file} does not exist")
        try:
            layers.append((OmegaConf.load(file), str(file)))
        except Exception as e:  # yaml errors come in several types
            raise ConfigError(f"cannot parse {file}: {e}") from e
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
    # Hydra's "+key=value" (add a key) and "++key=value" mean a plain override here.
    dotlist = [item.lstrip("+") for item in overrides]
    layers.append((OmegaConf.from_dotlist(dotlist), "the command line overrides"))
    try:
        layers = [_checked_layer(layer, source) for layer, source in layers]
        merged = OmegaConf.merge(schema, *layers)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(
                f"required settings missing: {missing}; set them in the YAML or as key=value"
            )
        cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except ConfigKeyError as e:
        raise unknown_keys_error(RunConfig, [str(e.full_key)], "the config") from None
    except ValidationError as e:
        allowed = _choice_fields(RunConfig).get(str(e.full_key))
        if allowed is not None:  # a word outside a Literal field's set
            raise ConfigError(f"{e.full_key}={e.value!r} is not one of {list(allowed)}") from None
        raise ConfigError(f"setting {e.full_key!r}: {e.msg}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(str(e)) from None
    validate(cfg)
    return cfg


def _checked_layer(layer: Any, source: str) -> Any:
    """A config layer with its keys checked against the schema (every unknown one named, with
    megarl's key for verl's) and single values taken as one-element lists where lists go."""
    tree = OmegaConf.to_container(layer, resolve=False)
    if not isinstance(tree, dict):
        raise ConfigError(f"{source} is not a mapping of sections (model:, data:, ...)")
    # A YAML mapping's keys: a key that is not a str is reported unknown like any other.
    unknown = prepare_layer(RunConfig, cast(dict[str, Any], tree))
    if unknown:
        raise unknown_keys_error(RunConfig, unknown, source)
    return OmegaConf.create(tree)


def validate(cfg: RunConfig, world_size: int | None = None) -> None:
    """Cross-setting checks; with ``world_size`` also the batch split over data-parallel ranks."""
    _validate_recompute(cfg.model)
    lora = cfg.actor.lora
    check_lora_settings(lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    if lora.rank and cfg.model.transformer_impl == "transformer_engine":
        raise ConfigError(
            "actor.lora adapts megatron's own parallel linears, not Transformer Engine's: set "
            "model.transformer_impl=local (or auto, which takes the local spec with LoRA)"
        )
    _check_choices(cfg)
    if not 0.0 < cfg.rollout.gpu_memory_utilization <= 1.0:
        raise ConfigError(
            f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} must be in "
            "(0, 1]: the share of each GPU's memory vLLM may take (e.g. 0.5)"
        )
    _validate_parallel(cfg.parallel)
    _validate_context_parallel(cfg)
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if getattr(cfg.model, name) < 0:
            raise ConfigError(f"model.{name}={getattr(cfg.model, name)} must be >= 0 (0: off)")
    if not 0.0 <= cfg.actor.optimizer_offload <= 1.0:
        raise ConfigError(
            f"actor.optimizer_offload={cfg.actor.optimizer_offload} must be in [0, 1]: the share "
            "of the optimizer states kept on the host (0: none, 1: all)"
        )
    bad_steps = [s for s in cfg.trainer.profile_steps if s < 1]
    if bad_steps:
        raise ConfigError(
            f"trainer.profile_steps={list(cfg.trainer.profile_steps)}: steps are numbered from 1, "
            "as logged; remove or fix these"
        )
    _validate_reliability(cfg)
    supervised = _SUPERVISED_VALIDATORS.get(cfg.trainer.kind)
    if supervised is not None:
        supervised(cfg, world_size)
        return
    data, actor = cfg.data, cfg.actor
    positive = {
        "data.train_batch_size": data.train_batch_size,
        "actor.ppo_mini_batch_size": actor.ppo_mini_batch_size,
        "actor.micro_batch_size": actor.micro_batch_size,
        "actor.ppo_epochs": actor.ppo_epochs,
        "rollout.n": cfg.rollout.n,
        "rollout.max_response_length": cfg.rollout.max_response_length,
        "rollout.max_num_seqs": cfg.rollout.max_num_seqs,
        "trainer.total_steps": cfg.trainer.total_steps,
    }
    _check_positive(positive)
    if actor.ppo_mini_batch_size > data.train_batch_size:
        raise ConfigError(
            f"actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} is larger than "
            f"data.train_batch_size={data.train_batch_size}; it must be at most the batch (and divide it)"
        )
    if data.train_batch_size % actor.ppo_mini_batch_size:
        raise ConfigError(
            f"data.train_batch_size={data.train_batch_size} is not a multiple of "
            f"actor.ppo_mini_batch_size={actor.ppo_mini_batch_size}; choose a mini-batch among its divisors"
        )
    _validate_sampling(cfg)
    _validate_async(cfg, world_size)
    _validate_distill(cfg)
    _validate_multi_turn(cfg.rollout)
    if cfg.reward.model_path is None and cfg.reward.rule_weight == 0:
        raise ConfigError(
            "reward.rule_weight=0 leaves no reward: set reward.model_path to a reward model, "
            "or a rule_weight > 0"
        )
    if world_size is not None:
        _check_dp_split(
            cfg,
            trainer_world_size(cfg, world_size),
            {
                "data.train_batch_size": data.train_batch_size,
                "actor.ppo_mini_batch_size": actor.ppo_mini_batch_size,
            },
        )


def _validate_sampling(cfg: RunConfig) -> None:
    r, a, trainer = cfg.rollout, cfg.algorithm, cfg.trainer
    if r.temperature < 0 or r.val_temperature < 0:
        raise ConfigError(
            "rollout.temperature and rollout.val_temperature must be >= 0 (0: greedy)"
        )
    _check_positive({"rollout.val_n": r.val_n})
    if r.val_n > 1 and r.val_temperature == 0:
        raise ConfigError(
            f"rollout.val_n={r.val_n} greedy samples are all the same answer; set "
            "rollout.val_temperature > 0 (e.g. 0.6) or val_n=1"
        )
    if trainer.val_before_train and not cfg.data.val_files:
        raise ConfigError("trainer.val_before_train=true needs data.val_files")
    if a.loss_agg_norm_length is not None and a.loss_agg_norm_length < 1:
        raise ConfigError(
            f"algorithm.loss_agg_norm_length must be >= 1 (or null: rollout.max_response_length), "
            f"got {a.loss_agg_norm_length}"
        )
    if a.filter_groups:
        _check_positive({"algorithm.filter_groups_max_batches": a.filter_groups_max_batches})
        if r.n < 2:
            raise ConfigError(
                f"algorithm.filter_groups keeps groups whose rewards differ, which needs "
                f"rollout.n >= 2 samples per prompt (got {r.n})"
            )
    buf = cfg.reward.overlong_buffer
    if not 0 <= buf.len < r.max_response_length:
        raise ConfigError(
            f"reward.overlong_buffer.len={buf.len} must be in [0, rollout.max_response_length="
            f"{r.max_response_length}); 0 turns the overlong penalty off"
        )
    if buf.penalty_factor < 0:
        raise ConfigError(
            f"reward.overlong_buffer.penalty_factor must be >= 0, got {buf.penalty_factor}"
        )
    if r.ignore_eos and buf.len > 0:
        raise ConfigError(
            "rollout.ignore_eos=true runs every response to rollout.max_response_length, so "
            "reward.overlong_buffer would give every one the same full penalty; set "
            "reward.overlong_buffer.len=0 or rollout.ignore_eos=false"
        )


def trainer_world_size(cfg: RunConfig, world_size: int) -> int:
    """Processes that train: the whole job, less the rollout group in async mode."""
    return world_size - cfg.parallel.rollout_ranks if cfg.rollout.mode == "async" else world_size


def job_world_size(cfg: RunConfig) -> int:
    """The smallest job for ``cfg``: one tp x pp trainer replica (and the rollout group)."""
    extra = cfg.parallel.rollout_ranks if cfg.rollout.mode == "async" else 0
    return cfg.parallel.tp * cfg.parallel.pp + extra


def _validate_async(cfg: RunConfig, world_size: int | None) -> None:
    """rollout.mode and the settings of asynchronous training (docs/async.md)."""
    r, par = cfg.rollout, cfg.parallel
    if r.max_staleness < 0:
        raise ConfigError(
            f"rollout.max_staleness={r.max_staleness} must be >= 0: how many optimizer steps "
            "the rollout may run behind the trainer (0: on-policy)"
        )
    if r.partial_chunk_tokens < 1:
        raise ConfigError(
            f"rollout.partial_chunk_tokens={r.partial_chunk_tokens} must be >= 1 (tokens "
            "generated between two checks for new weights)"
        )
    if r.mode != "async":
        if par.rollout_ranks:
            raise ConfigError(
                f"parallel.rollout_ranks={par.rollout_ranks} sets aside ranks for the rollout "
                "group of asynchronous training: add rollout.mode=async, or set "
                "parallel.rollout_ranks=0 (colocated: every rank rolls out and trains)"
            )
        if r.partial:
            raise ConfigError(
                "rollout.partial=true continues generation across weight updates, which happen "
                "during generation only in asynchronous training: set rollout.mode=async (with "
                "parallel.rollout_ranks) or rollout.partial=false"
            )
        return
    infer_tp = par.infer_tp or par.tp
    if par.rollout_ranks < 1 or par.rollout_ranks % infer_tp:
        raise ConfigError(
            f"rollout.mode=async needs parallel.rollout_ranks, a positive multiple of "
            f"parallel.infer_tp={infer_tp} (each rollout engine spans infer_tp ranks); got "
            f"{par.rollout_ranks}"
        )
    for key, on in (
        ("actor.param_offload", cfg.actor.param_offload),
        ("ref.param_offload", cfg.ref.param_offload),
        ("critic.param_offload", cfg.critic.param_offload),
    ):
        if on:
            raise ConfigError(
                f"{key}=true moves a model to host memory while the rollout engine generates on "
                "the same GPU; in rollout.mode=async the trainer ranks hold no rollout engine: "
                f"set {key}=false"
            )
    if cfg.trainer.elastic.max_restarts:
        raise ConfigError(
            "trainer.elastic.max_restarts re-plans the trainers' layout on the ranks left after "
            "a failure, which does not yet account for the rollout group of rollout.mode=async: "
            "set trainer.elastic.max_restarts=0 (resume from the latest checkpoint by hand) or "
            "rollout.mode=colocated"
        )
    if r.env is not None and r.partial:
        raise ConfigError(
            "rollout.partial=true continues single-turn responses across weight updates; the "
            f"multi-turn trajectories of rollout.env={r.env!r} are generated turn by turn with "
            "one version's weights: set rollout.partial=false or unset rollout.env"
        )
    if world_size is None:
        return
    trainers = world_size - par.rollout_ranks
    if trainers < 1 or trainers % (par.tp * par.pp):
        raise ConfigError(
            f"parallel.rollout_ranks={par.rollout_ranks} of the job's {world_size} processes "
            f"leave {max(trainers, 0)} trainer ranks, which must be a positive multiple of "
            f"tp*pp = {par.tp * par.pp}; lower rollout_ranks or start "
            f"{par.rollout_ranks + par.tp * par.pp} or more processes"
        )


def _validate_multi_turn(r: RolloutConfig) -> None:
    """The pure checks of rollout.env's settings (the class itself is loaded by run/checks.py)."""
    if r.env is None:
        set_ = [k for k in ("env_kwargs",) if getattr(r, k)]
        if set_:
            raise ConfigError(f"rollout.{set_[0]} is set but rollout.env is not; set rollout.env")
        return
    _check_positive(
        {"rollout.max_turns": r.max_turns, "rollout.tool_concurrency": r.tool_concurrency}
    )
    if r.max_turn_tokens is not None and not 1 <= r.max_turn_tokens <= r.max_response_length:
        raise ConfigError(
            f"rollout.max_turn_tokens={r.max_turn_tokens} must be in [1, rollout.max_response_length="
            f"{r.max_response_length}] (or null: the whole budget)"
        )
    if not r.tool_timeout_s > 0:
        raise ConfigError(f"rollout.tool_timeout_s={r.tool_timeout_s} must be > 0 seconds")
    if not 0.0 <= r.max_env_failures <= 1.0:
        raise ConfigError(
            f"rollout.max_env_failures={r.max_env_failures} must be a share in [0, 1] of a "
            "step's samples"
        )


def _validate_reliability(cfg: RunConfig) -> None:
    t = cfg.trainer
    if t.keep_last < 1:
        raise ConfigError(
            f"trainer.keep_last={t.keep_last}: at least the newest checkpoint must be kept; "
            "set trainer.keep_last >= 1"
        )
    if t.keep_every < 0:
        raise ConfigError(
            f"trainer.keep_every={t.keep_every} must be >= 0 (0 keeps no extra checkpoints)"
        )
    if not 0.0 <= cfg.reward.max_failed_fraction <= 1.0:
        raise ConfigError(
            f"reward.max_failed_fraction={cfg.reward.max_failed_fraction} must be in [0, 1]: the "
            "share of a step's samples that may fail to score before the run stops (1.0: never)"
        )
    if not t.hang_timeout_s > 0:
        raise ConfigError(
            f"trainer.hang_timeout_s={t.hang_timeout_s} must be > 0 seconds; set it above the "
            "longest step phase (rollout, update, checkpoint save) of the run, e.g. 1800"
        )
    _validate_elastic(t.elastic)


def _validate_elastic(e: ElasticConfig) -> None:
    if e.max_restarts < 0:
        raise ConfigError(
            f"trainer.elastic.max_restarts={e.max_restarts} must be >= 0 (0: no restarts)"
        )
    if e.min_world_size < 1:
        raise ConfigError(f"trainer.elastic.min_world_size={e.min_world_size} must be >= 1 (ranks)")
    if e.wait_s < 0:
        raise ConfigError(f"trainer.elastic.wait_s={e.wait_s} must be >= 0 seconds")


def _validate_recompute(model: ModelConfig) -> None:
    if model.recompute_num_layers < 1:
        raise ConfigError(
            f"model.recompute_num_layers={model.recompute_num_layers} must be >= 1 "
            "(layers per recomputed checkpoint with model.recompute=full)"
        )


def _validate_parallel(par: ParallelConfig) -> None:
    if par.sequence_parallel and par.tp == 1:
        raise ConfigError(
            "parallel.sequence_parallel=true needs tensor parallelism: set parallel.tp > 1, or "
            "parallel.sequence_parallel=false (unset, it is on exactly when tp > 1)"
        )


def sequence_budget(cfg: RunConfig) -> tuple[int, str]:
    """The longest sequence a run trains on, and the settings that make it up."""
    if cfg.trainer.kind in _SUPERVISED_VALIDATORS:  # one max_length setting per such trainer
        section = cfg.trainer.kind
        return getattr(cfg, section).max_length, f"{section}.max_length"
    return (
        cfg.data.max_prompt_length + cfg.rollout.max_response_length,
        "data.max_prompt_length + rollout.max_response_length",
    )


def _validate_context_parallel(cfg: RunConfig) -> None:
    """The pure part of the parallel.cp checks (Transformer Engine's presence is checked with the
    other backends, megarl.backends)."""
    cp = cfg.parallel.cp
    if cp < 1:
        raise ConfigError(f"parallel.cp={cp} must be >= 1 (1: no context parallelism)")
    if cp == 1:
        return
    budget, what = sequence_budget(cfg)
    # Megatron's causal context parallelism cuts each sequence into 2 * cp chunks (each rank
    # takes one early and one late chunk, to even out the causal attention's work).
    if budget % (2 * cp):
        raise ConfigError(
            f"parallel.cp={cp} does not divide the sequence budget: {what} = {budget} must be a "
            f"multiple of 2 * cp = {2 * cp}; change the lengths or parallel.cp"
        )


def _check_positive(values: dict[str, int]) -> None:
    for key, value in values.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")


def _check_dp_split(cfg: RunConfig, world_size: int, batches: dict[str, int]) -> None:
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if world_size % (tp * pp):
        raise ConfigError(f"{world_size} processes cannot hold parallel.tp*pp = {tp}*{pp}")
    dp = world_size // (tp * pp)
    for key, value in batches.items():
        if value % dp:
            raise ConfigError(
                f"{key}={value} is not divisible by the {dp} data-parallel ranks "
                f"({world_size} processes / tp*pp {tp * pp}); make it a multiple of {dp}"
            )


def _validate_supervised(
    cfg: RunConfig, world_size: int | None, section: str, micro_batch_size: int, max_length: int
) -> None:
    """What the reward-model, SFT and DPO trainers share: positive sizes, a usable max_length,
    batches that split over the data-parallel ranks."""
    data = cfg.data
    _check_positive(
        {
            "data.train_batch_size": data.train_batch_size,
            f"{section}.micro_batch_size": micro_batch_size,
            "trainer.total_steps": cfg.trainer.total_steps,
        }
    )
    if max_length < 2:
        raise ConfigError(f"{section}.max_length must be >= 2 tokens, got {max_length}")
    if world_size is not None:
        batches = {"data.train_batch_size": data.train_batch_size}
        if data.val_files:
            batches["data.val_batch_size"] = data.val_batch_size
        _check_dp_split(cfg, world_size, batches)


def _validate_reward_model(cfg: RunConfig, world_size: int | None) -> None:
    rm = cfg.reward_model
    _validate_supervised(cfg, world_size, "reward_model", rm.micro_batch_size, rm.max_length)


def _validate_sft(cfg: RunConfig, world_size: int | None) -> None:
    sft = cfg.sft
    _validate_supervised(cfg, world_size, "sft", sft.micro_batch_size, sft.max_length)
    budget = sft.max_tokens_per_micro_batch
    if budget is not None and budget < 2:
        raise ConfigError(
            f"sft.max_tokens_per_micro_batch={budget} must be >= 2 tokens (or null: "
            "sft.micro_batch_size sequences per micro-batch)"
        )


def _validate_dpo(cfg: RunConfig, world_size: int | None) -> None:
    dpo = cfg.dpo
    _validate_supervised(cfg, world_size, "dpo", dpo.micro_batch_size, dpo.max_length)


_SUPERVISED_VALIDATORS = {
    "reward_model": _validate_reward_model,
    "sft": _validate_sft,
    "dpo": _validate_dpo,
}


def _validate_distill(cfg: RunConfig) -> None:
    d = cfg.algorithm.distill
    if d.teacher_path is not None and not d.coef > 0:
        raise ConfigError(
            f"algorithm.distill.coef={d.coef} must be > 0 with a teacher "
            "(algorithm.distill.teacher_path); remove the teacher to train without distillation"
        )


def model_dtype(cfg: RunConfig, cuda: bool) -> str:
    """The models' dtype name: model.dtype, where auto is bfloat16 on CUDA and float32 on CPU."""
    if cfg.model.dtype == "auto":
        return "bfloat16" if cuda else "float32"
    return cfg.model.dtype


def rollout_dtype(cfg: RunConfig, cuda: bool) -> str:
    """The rollout engine's dtype name: rollout.dtype, where auto is the models' dtype."""
    return model_dtype(cfg, cuda) if cfg.rollout.dtype == "auto" else cfg.rollout.dtype


def to_flat_dict(cfg: RunConfig) -> dict[str, Any]:
    """Dotted key -> value, e.g. for MLflow params."""
    container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)

    def walk(node: Any, prefix: str) -> dict[str, Any]:
        if isinstance(node, dict):
            out: dict[str, Any] = {}
            for k, v in node.items():
                out.update(walk(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: node}

    return walk(container, "")
