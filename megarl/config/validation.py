"""The cross-setting checks of a run's config (batch splits, async and multi-turn settings,
reliability, elastic, distillation; the supervised trainers' in
:mod:`megarl.config.supervised_validation`) (the values derived from several settings are in
:mod:`megarl.config.derived`)."""

from __future__ import annotations

from collections.abc import Mapping

from megarl.config.batch_checks import check_dp_split, check_positive
from megarl.config.derived import sequence_budget, trainer_world_size
from megarl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    DataConfig,
    DistillConfig,
    ElasticConfig,
    JudgeConfig,
    ModelConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
)
from megarl.config.supervised_validation import SUPERVISED_VALIDATORS, SupervisedShared
from megarl.config.words import check_field_words
from megarl.errors import ConfigError
from megarl.lora_settings import check_lora_settings


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
    check_field_words(cfg)
    if not 0.0 < cfg.rollout.engine.gpu_memory_utilization <= 1.0:
        raise ConfigError(
            f"rollout.engine.gpu_memory_utilization={cfg.rollout.engine.gpu_memory_utilization} must be in "
            "(0, 1]: the share of each GPU's memory vLLM may take (e.g. 0.5)"
        )
    _validate_parallel(cfg.parallel)
    _validate_context_parallel(cfg.parallel.cp, sequence_budget(cfg))
    _validate_share_prompts(cfg.actor, cfg.model, cfg.parallel)
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
    _validate_reliability(cfg.trainer, cfg.reward)
    supervised = SUPERVISED_VALIDATORS.get(cfg.trainer.kind)
    if supervised is not None:  # its own section (named as the kind), and the shared settings
        shared = SupervisedShared(cfg.data, cfg.trainer, cfg.parallel, world_size)
        supervised(getattr(cfg, cfg.trainer.kind), shared)
        return
    data, actor = cfg.data, cfg.actor
    positive = {
        "data.train_batch_size": data.train_batch_size,
        "actor.ppo_mini_batch_size": actor.ppo_mini_batch_size,
        "actor.micro_batch_size": actor.micro_batch_size,
        "actor.ppo_epochs": actor.ppo_epochs,
        "rollout.sampling.n": cfg.rollout.sampling.n,
        "rollout.sampling.max_response_length": cfg.rollout.sampling.max_response_length,
        "rollout.engine.max_num_seqs": cfg.rollout.engine.max_num_seqs,
        "trainer.total_steps": cfg.trainer.total_steps,
    }
    check_positive(positive)
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
    _validate_sampling(cfg.rollout, cfg.algorithm, cfg.trainer, cfg.data, cfg.reward)
    offloads = {
        "actor.param_offload": cfg.actor.param_offload,
        "ref.param_offload": cfg.ref.param_offload,
        "critic.param_offload": cfg.critic.param_offload,
    }
    _validate_async(cfg.rollout, cfg.parallel, offloads, cfg.trainer.elastic, world_size)
    _validate_distill(cfg.algorithm.distill)
    _validate_multi_turn(cfg.rollout)
    _validate_agent(cfg.rollout, cfg.trainer.hang_timeout_s)
    r = cfg.reward
    judged = r.judge.model_path is not None or r.judge.url is not None
    if r.rule_weight == 0 and r.model_path is None and r.remote_url is None and not judged:
        raise ConfigError(
            "reward.rule_weight=0 leaves no reward: set reward.model_path to a reward model, "
            "reward.remote_url to a reward service, reward.judge.model_path or reward.judge.url "
            "to a judge, or a rule_weight > 0"
        )
    _validate_remote_reward(cfg.reward)
    _validate_judge(cfg.reward.judge)
    if world_size is not None:
        check_dp_split(
            cfg.parallel,
            trainer_world_size(cfg.parallel, cfg.rollout, world_size),
            {
                "data.train_batch_size": data.train_batch_size,
                "actor.ppo_mini_batch_size": actor.ppo_mini_batch_size,
            },
        )


def _validate_remote_reward(r: RewardConfig) -> None:
    """``reward.remote_*`` (read only when ``reward.remote_url`` is set)."""
    if r.remote_url is None:
        return
    if not r.remote_url.startswith(("http://", "https://")):
        raise ConfigError(f"reward.remote_url={r.remote_url!r} must be an http:// or https:// URL")
    for name, value, least in (
        ("remote_batch_size", r.remote_batch_size, 1),
        ("remote_concurrency", r.remote_concurrency, 1),
        ("remote_retries", r.remote_retries, 0),
    ):
        if value < least:
            raise ConfigError(f"reward.{name}={value} must be >= {least}")
    if not r.remote_timeout_s > 0:
        raise ConfigError(f"reward.remote_timeout_s={r.remote_timeout_s} must be > 0 seconds")
    if not r.remote_backoff_s >= 0:
        raise ConfigError(f"reward.remote_backoff_s={r.remote_backoff_s} must be >= 0 seconds")


def _validate_judge(j: JudgeConfig) -> None:
    """``reward.judge.*`` (read only when a judge is set; its template and score pattern are
    checked with the inputs, megarl.run.checks)."""
    if j.model_path is None and j.url is None:
        return
    if j.model_path is not None and j.url is not None:
        raise ConfigError(
            "reward.judge.model_path and reward.judge.url are both set; a judge runs here "
            "(model_path) or at a server (url): unset one"
        )
    if j.url is not None:
        if not j.url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.judge.url={j.url!r} must be an http:// or https:// URL")
        if not j.model:
            raise ConfigError(
                f"reward.judge.url={j.url} needs reward.judge.model: the name the server serves "
                "the judge under (its GET /models lists them)"
            )
    check_positive(
        {
            "reward.judge.max_tokens": j.max_tokens,
            "reward.judge.concurrency": j.concurrency,
        }
    )
    if j.max_length <= j.max_tokens:
        raise ConfigError(
            f"reward.judge.max_length={j.max_length} leaves no room for a prompt beside "
            f"reward.judge.max_tokens={j.max_tokens}; raise max_length"
        )
    if j.retries < 0:
        raise ConfigError(f"reward.judge.retries={j.retries} must be >= 0")
    if not j.timeout_s > 0:
        raise ConfigError(f"reward.judge.timeout_s={j.timeout_s} must be > 0 seconds")


def _validate_sampling(
    r: RolloutConfig,
    a: AlgorithmConfig,
    trainer: TrainerConfig,
    data: DataConfig,
    reward: RewardConfig,
) -> None:
    if r.sampling.temperature < 0 or r.sampling.val_temperature < 0:
        raise ConfigError(
            "rollout.sampling.temperature and rollout.sampling.val_temperature must be >= 0 (0: greedy)"
        )
    check_positive({"rollout.sampling.val_n": r.sampling.val_n})
    if r.sampling.val_n > 1 and r.sampling.val_temperature == 0:
        raise ConfigError(
            f"rollout.sampling.val_n={r.sampling.val_n} greedy samples are all the same answer; set "
            "rollout.sampling.val_temperature > 0 (e.g. 0.6) or val_n=1"
        )
    if trainer.val_before_train and not data.val_files:
        raise ConfigError("trainer.val_before_train=true needs data.val_files")
    if a.loss_agg_norm_length is not None and a.loss_agg_norm_length < 1:
        raise ConfigError(
            f"algorithm.loss_agg_norm_length must be >= 1 (or null: rollout.sampling.max_response_length), "
            f"got {a.loss_agg_norm_length}"
        )
    if a.filter_groups:
        check_positive({"algorithm.filter_groups_max_batches": a.filter_groups_max_batches})
        if r.sampling.n < 2:
            raise ConfigError(
                f"algorithm.filter_groups keeps groups whose rewards differ, which needs "
                f"rollout.sampling.n >= 2 samples per prompt (got {r.sampling.n})"
            )
    buf = reward.overlong_buffer
    if not 0 <= buf.len < r.sampling.max_response_length:
        raise ConfigError(
            f"reward.overlong_buffer.len={buf.len} must be in [0, rollout.sampling.max_response_length="
            f"{r.sampling.max_response_length}); 0 turns the overlong penalty off"
        )
    if buf.penalty_factor < 0:
        raise ConfigError(
            f"reward.overlong_buffer.penalty_factor must be >= 0, got {buf.penalty_factor}"
        )
    if r.sampling.ignore_eos and buf.len > 0:
        raise ConfigError(
            "rollout.sampling.ignore_eos=true runs every response to rollout.sampling.max_response_length, so "
            "reward.overlong_buffer would give every one the same full penalty; set "
            "reward.overlong_buffer.len=0 or rollout.sampling.ignore_eos=false"
        )


def _validate_async(
    r: RolloutConfig,
    par: ParallelConfig,
    offloads: Mapping[str, bool],
    elastic: ElasticConfig,
    world_size: int | None,
) -> None:
    """rollout.placement.mode and the settings of asynchronous training (docs/async.md); ``offloads``:
    each model's param_offload setting by its key."""
    if r.placement.max_staleness < 0:
        raise ConfigError(
            f"rollout.placement.max_staleness={r.placement.max_staleness} must be >= 0: how many optimizer steps "
            "the rollout may run behind the trainer (0: on-policy)"
        )
    if r.placement.partial_chunk_tokens < 1:
        raise ConfigError(
            f"rollout.placement.partial_chunk_tokens={r.placement.partial_chunk_tokens} must be >= 1 (tokens "
            "generated between two checks for new weights)"
        )
    if r.placement.mode != "async":
        if par.rollout_ranks:
            raise ConfigError(
                f"parallel.rollout_ranks={par.rollout_ranks} sets aside ranks for the rollout "
                "group of asynchronous training: add rollout.placement.mode=async, or set "
                "parallel.rollout_ranks=0 (colocated: every rank rolls out and trains)"
            )
        if r.placement.partial:
            raise ConfigError(
                "rollout.placement.partial=true continues generation across weight updates, which happen "
                "during generation only in asynchronous training: set rollout.placement.mode=async (with "
                "parallel.rollout_ranks) or rollout.placement.partial=false"
            )
        return
    infer_tp = par.infer_tp or par.tp
    if par.rollout_ranks < 1 or par.rollout_ranks % infer_tp:
        raise ConfigError(
            f"rollout.placement.mode=async needs parallel.rollout_ranks, a positive multiple of "
            f"parallel.infer_tp={infer_tp} (each rollout engine spans infer_tp ranks); got "
            f"{par.rollout_ranks}"
        )
    for key, on in offloads.items():
        if on:
            raise ConfigError(
                f"{key}=true moves a model to host memory while the rollout engine generates on "
                "the same GPU; in rollout.placement.mode=async the trainer ranks hold no rollout engine: "
                f"set {key}=false"
            )
    if elastic.max_restarts:
        raise ConfigError(
            "trainer.elastic.max_restarts re-plans the trainers' layout on the ranks left after "
            "a failure, which does not yet account for the rollout group of rollout.placement.mode=async: "
            "set trainer.elastic.max_restarts=0 (resume from the latest checkpoint by hand) or "
            "rollout.placement.mode=colocated"
        )
    if r.env is not None and r.placement.partial:
        raise ConfigError(
            "rollout.placement.partial=true continues single-turn responses across weight updates; the "
            f"multi-turn trajectories of rollout.env={r.env!r} are generated turn by turn with "
            "one version's weights: set rollout.placement.partial=false or unset rollout.env"
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
    check_positive(
        {
            "rollout.environment.max_turns": r.environment.max_turns,
            "rollout.environment.tool_concurrency": r.environment.tool_concurrency,
        }
    )
    if (
        r.environment.max_turn_tokens is not None
        and not 1 <= r.environment.max_turn_tokens <= r.sampling.max_response_length
    ):
        raise ConfigError(
            f"rollout.environment.max_turn_tokens={r.environment.max_turn_tokens} must be in [1, rollout.sampling.max_response_length="
            f"{r.sampling.max_response_length}] (or null: the whole budget)"
        )
    if not r.environment.tool_timeout_s > 0:
        raise ConfigError(
            f"rollout.environment.tool_timeout_s={r.environment.tool_timeout_s} must be > 0 seconds"
        )
    if not 0.0 <= r.environment.max_env_failures <= 1.0:
        raise ConfigError(
            f"rollout.environment.max_env_failures={r.environment.max_env_failures} must be a share in [0, 1] of a "
            "step's samples"
        )


def _validate_agent(r: RolloutConfig, hang_timeout_s: float) -> None:
    """The pure checks of rollout.agent's settings (the function itself is loaded by
    run/checks.py), and the settings it does not work with yet. One agent's time limit must be
    below the hang watchdog's: a step whose agent ran up to its limit would otherwise be taken
    for a hung rank and the run ended, where the agent's sample should only have scored 0."""
    if r.agent is None:
        return
    check_positive({"rollout.agent_concurrency": r.agent_concurrency})
    if not r.agent_timeout_s > 0:
        raise ConfigError(f"rollout.agent_timeout_s={r.agent_timeout_s} must be > 0 seconds")
    if r.agent_timeout_s >= hang_timeout_s:
        raise ConfigError(
            f"rollout.agent_timeout_s={r.agent_timeout_s:g} is not below "
            f"trainer.hang_timeout_s={hang_timeout_s:g}: the watchdog bounds the whole rollout, "
            "so one agent could never use its limit (a step's agents share 0.8 x "
            "trainer.hang_timeout_s); lower rollout.agent_timeout_s or raise "
            "trainer.hang_timeout_s"
        )
    refusals = (
        (
            r.env is not None,
            f"rollout.env={r.env!r}: an agent drives its own conversation, an environment "
            "answers the model's turns; a run has one or the other: unset one of them",
        ),
        (
            r.placement.partial,
            "rollout.placement.partial=true: an agent's turns are sampled with one version's weights; set "
            "rollout.placement.partial=false",
        ),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"rollout.agent={r.agent!r} with {why}")


def _validate_reliability(t: TrainerConfig, reward: RewardConfig) -> None:
    if t.keep_last < 1:
        raise ConfigError(
            f"trainer.keep_last={t.keep_last}: at least the newest checkpoint must be kept; "
            "set trainer.keep_last >= 1"
        )
    for key, every in (("save_freq", t.save_freq), ("test_freq", t.test_freq)):
        if every < 0:
            raise ConfigError(
                f"trainer.{key}={every} must be >= 0 (a number of steps; 0: "
                f"{'only the final checkpoint' if key == 'save_freq' else 'never'}; verl's -1 "
                "is read as 0)"
            )
    if t.keep_every < 0:
        raise ConfigError(
            f"trainer.keep_every={t.keep_every} must be >= 0 (0 keeps no extra checkpoints)"
        )
    if not 0.0 <= reward.max_failed_fraction <= 1.0:
        raise ConfigError(
            f"reward.max_failed_fraction={reward.max_failed_fraction} must be in [0, 1]: the "
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


def _validate_share_prompts(actor: ActorConfig, model: ModelConfig, par: ParallelConfig) -> None:
    """actor.share_prompts rides on packing and on megarl's own SDPA attention (its masks)."""
    if not actor.share_prompts:
        return
    problems = (
        (
            not actor.packing,
            "actor.packing=false",
            "set actor.packing=true (the shared prompt lives in a pack)",
        ),
        (
            model.transformer_impl == "transformer_engine",
            "model.transformer_impl=transformer_engine",
            "set model.transformer_impl=local (Transformer Engine's fused attention cannot take "
            "the per-group masks)",
        ),
        (
            par.cp > 1,
            f"parallel.cp={par.cp}",
            "set parallel.cp=1 (context parallelism splits sequences, not prompt groups)",
        ),
    )
    for bad, what, fix in problems:
        if bad:
            raise ConfigError(
                f"actor.share_prompts=true with {what}: {fix}, or set actor.share_prompts=false"
            )


def _validate_context_parallel(cp: int, sequence: tuple[int, str]) -> None:
    """The pure part of the parallel.cp checks (Transformer Engine's presence is checked with the
    other backends, megarl.backends); ``sequence``: the run's sequence budget and its settings."""
    if cp < 1:
        raise ConfigError(f"parallel.cp={cp} must be >= 1 (1: no context parallelism)")
    if cp == 1:
        return
    budget, what = sequence
    # Megatron's causal context parallelism cuts each sequence into 2 * cp chunks (each rank
    # takes one early and one late chunk, to even out the causal attention's work).
    if budget % (2 * cp):
        raise ConfigError(
            f"parallel.cp={cp} does not divide the sequence budget: {what} = {budget} must be a "
            f"multiple of 2 * cp = {2 * cp}; change the lengths or parallel.cp"
        )


def _validate_distill(d: DistillConfig) -> None:
    if d.teacher_path is not None and not d.coef > 0:
        raise ConfigError(
            f"algorithm.distill.coef={d.coef} must be > 0 with a teacher "
            "(algorithm.distill.teacher_path); remove the teacher to train without distillation"
        )
