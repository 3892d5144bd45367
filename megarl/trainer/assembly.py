"""The run assembly of ``megarl train``: small builders, each returning a frozen, typed part of
the run, and :func:`setup_run` putting them together in order (the cheap checks first).

A :class:`PolicyRun` holds what the loop needs; its parts own their state (models, data position,
KL coefficient, tracker), the run object itself is never rebound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megarl import parallel, platform
from megarl.algos.kl import KLController
from megarl.config import (
    ActorConfig,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    rollout_dtype,
)
from megarl.config.derived import routing_recorded
from megarl.console import announce
from megarl.data import PromptDataset, PromptItem
from megarl.envs.chat_deltas import ChatDeltas
from megarl.envs.loading import check_environment
from megarl.envs.pool import ToolPool
from megarl.envs.runner import EnvRunner
from megarl.hybrid_engine.async_links import make_links, weight_schedule
from megarl.hybrid_engine.engine import HybridEngine
from megarl.hybrid_engine.engine_folder import eos_token_ids
from megarl.hybrid_engine.multi_turn import TurnLimits
from megarl.hybrid_engine.rollout_types import EngineConfig, SamplingConfig
from megarl.hybrid_engine.weight_sync import WeightSender
from megarl.models.build import ModelOptions
from megarl.models.dims import ModelDims
from megarl.models.router_replay import replay_routers
from megarl.rewards.model import build_reward_model
from megarl.run.checks import rules_need_ground_truth
from megarl.run.epochs import EpochBatches
from megarl.run.resume import Resumed, resume, resume_point, save, tracked_start
from megarl.run.startup import Startup, start
from megarl.run.steps import announce_steps
from megarl.run.tracking import Tracker
from megarl.run.trainable import model_options
from megarl.trainer.agent_rollout import agent_source
from megarl.trainer.experience import RewardSources
from megarl.trainer.model_ops import MicroBatching
from megarl.trainer.remote_rollout import (
    KeptActorMemory,
    RemoteBatches,
    RemoteRollout,
    RemoteTrainData,
    RemoteValidation,
)
from megarl.trainer.roles import Roles, RoleSections, build_roles
from megarl.trainer.rollout_offload import (
    ActorMemory,
    RoleOffload,
    build_actor_memory,
    build_role_offload,
)
from megarl.trainer.spec import AlgorithmSpec, make_kl_in_reward_controller, resolve_algorithm

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from transformers import PreTrainedTokenizerBase

    from megarl.agents.trajectories import AgentSource


@dataclass(frozen=True)
class Rollout:
    """The rollout engine and how it samples (training and validation rollouts): the colocated
    hybrid engine, or in asynchronous mode the rollout group behind the same seam (``remote``)."""

    engine: HybridEngine | RemoteRollout
    sampling: SamplingConfig
    val_sampling: SamplingConfig
    # the actor's grads freed, its optimizer state (GPU) or whole model on the host while the
    # engine is awake (megarl.trainer.rollout_offload); async: kept as they are
    actor_memory: ActorMemory | KeptActorMemory
    # ref.param_offload / critic.param_offload: those models on the host while the engine is awake
    roles_offload: RoleOffload = field(default_factory=lambda: RoleOffload({}))
    remote: RemoteRollout | None = None  # rollout.mode=async
    # rollout.env: multi-turn trajectories (the runner exists on the ranks that run environments)
    turns: TurnLimits | None = None
    env_runner: EnvRunner | None = None
    max_env_failures: float = 1.0
    agent: AgentSource | None = None  # rollout.agent (megarl.trainer.agent_rollout)

    def close(self) -> None:
        if self.env_runner is not None:
            self.env_runner.close()


@dataclass(frozen=True)
class PolicyData:
    """The prompts: read here (colocated), or by the rollout group (async: ``Remote*``)."""

    train: PromptDataset | RemoteTrainData
    val: PromptDataset | RemoteValidation | None
    batches: EpochBatches[list[PromptItem]] | RemoteBatches  # epoch after epoch


@dataclass(frozen=True)
class PolicyRun:
    cfg: RunConfig
    startup: Startup  # layout, rank, tokenizer
    spec: AlgorithmSpec
    roles: Roles
    rollout: Rollout
    data: PolicyData
    rewards: RewardSources
    kl_ctrl: KLController | None
    batching: MicroBatching
    tracker: Tracker
    resumed: Resumed

    def mini_batches(self, size: int) -> list[list[int]]:
        """Rows of each mini-batch of a rollout of ``size`` rows on this rank: whole prompt
        groups, in rollout order."""
        per_rank_prompts = self.cfg.actor.ppo_mini_batch_size // self.startup.layout.dp
        rows = per_rank_prompts * self.cfg.rollout.n
        return [list(range(s, min(s + rows, size))) for s in range(0, size, rows)]

    def save_checkpoint(self, step: int, history: list[dict[str, float]]) -> Path:
        """Models, optimizers and the trainer state after ``step`` (collective); its folder."""
        remote = self.rollout.remote
        # async: first the batch in flight (its rollout count is the one to continue from)
        in_flight = remote.checkpoint_state() if remote is not None else {}
        return save(
            self.cfg.trainer,
            self.cfg.model.path,
            step,
            self.roles,
            data=self.data.train.state_dict(),
            mlflow_run_id=self.tracker.mlflow_run_id,
            history=history,
            kl_ctrl=self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
            rollouts=self.rollout.engine.rollout_count,
            **in_flight,
        )

    def close(self) -> None:
        if self.rollout.remote is not None:
            self.rollout.remote.close()
        self.tracker.close()
        self.rewards.close()
        self.rollout.close()


def prompt_dataset(
    data: DataConfig,
    reward: RewardConfig,
    tokenizer,
    validation: bool,
    dp_rank: int,
    dp_size: int,
) -> PromptDataset:
    """Data-parallel rank ``dp_rank``'s training prompts (sharded, shuffled as configured) or
    validation prompts (every prompt once per pass, in file order, no row dropped); ``reward``
    says whether each prompt must carry its ground truth."""
    files = data.val_files if validation else data.train_files
    batch = data.val_batch_size if validation else data.train_batch_size
    return PromptDataset(
        files,
        tokenizer,
        batch_size_per_rank=max(1, batch // dp_size),
        max_prompt_length=data.max_prompt_length,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=data.seed,
        shuffle=data.shuffle and not validation,
        drop_last=not validation,
        overlong_prompts=data.overlong_prompts,
        require_ground_truth=rules_need_ground_truth(reward),
        setting="data.val_files" if validation else "data.train_files",
    )


EMPTY_TRAIN_DATA = "the training data yields no batch: fewer prompts than data.train_batch_size"


def build_data(data: DataConfig, reward: RewardConfig, startup: Startup) -> PolicyData:
    """This data-parallel rank's training and validation prompts."""
    dp, rank = startup.layout.dp, parallel.dp_rank()
    train = prompt_dataset(data, reward, startup.tokenizer, False, rank, dp)
    val = (
        prompt_dataset(data, reward, startup.tokenizer, True, rank, dp) if data.val_files else None
    )
    return PolicyData(train, val, EpochBatches(train, EMPTY_TRAIN_DATA))


def build_rewards(
    reward: RewardConfig,
    rollout: RolloutConfig,
    model_cfg: ModelConfig,
    options: ModelOptions,
    startup: Startup,
) -> RewardSources:
    """Rule scorers, and the frozen reward model of ``reward.model_path`` (built with the
    models' ``options``) when one is set; a local judge runs in the rollout's dtype."""
    model: GPTModel | None = None
    if reward.model_path:
        model = build_reward_model(reward.model_path, startup.layout, options)
    judge_dtype = rollout_dtype(model_cfg, rollout, platform.device().type == "cuda")
    return RewardSources.from_config(reward, model, rollout.max_response_length, judge_dtype)


def _engine_seed(rollout: RolloutConfig, run_seed: int, engine_index: int) -> int:
    """vLLM's engine seed: with per-request seeds it drives no sampling; without them each engine
    draws from its own stream (engines seeded alike would repeat each other's random numbers)."""
    if rollout.per_request_seeds:
        return run_seed
    return run_seed + engine_index


def engine_config(
    model: ModelConfig,
    data: DataConfig,
    r: RolloutConfig,
    run_seed: int,
    engine_index: int,
    *,
    record_routes: bool = False,
) -> EngineConfig:
    """The rollout engine's settings (``run_seed``: trainer.seed); ``engine_index``: which engine
    of the run this rank's is; ``record_routes``: it records each token's experts (an MoE policy,
    megarl.models.router_replay)."""
    return EngineConfig(
        max_model_len=data.max_prompt_length + r.max_response_length,
        kv_cache_bytes=int(r.kv_cache_gib * (1 << 30)),
        dtype=rollout_dtype(model, r, platform.device().type == "cuda"),
        seed=_engine_seed(r, run_seed, engine_index),
        max_num_seqs=r.max_num_seqs,
        gpu_memory_utilization=r.gpu_memory_utilization,
        sleep_level=r.sleep_level,
        record_routes=record_routes,
    )


def sampling_configs(r: RolloutConfig, run_seed: int) -> tuple[SamplingConfig, SamplingConfig]:
    """How training and validation rollouts sample (``run_seed``: trainer.seed)."""
    # rollout.ignore_eos: no stop tokens either (the model's EOS ids would still end a response)
    stop_token_ids = () if r.ignore_eos else None
    sampling = SamplingConfig(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_response_length,
        n=r.n,
        seed=run_seed,
        per_request_seeds=r.per_request_seeds,
        ignore_eos=r.ignore_eos,
        stop_token_ids=stop_token_ids,
    )
    val_sampling = SamplingConfig(
        temperature=r.val_temperature,
        max_new_tokens=r.max_response_length,
        n=r.val_n,
        seed=run_seed,
        per_request_seeds=r.per_request_seeds,
        ignore_eos=r.ignore_eos,
        stop_token_ids=stop_token_ids,
    )
    return sampling, val_sampling


def colocated_rollout(cfg: RunConfig, startup: Startup, roles: Roles) -> Rollout:
    r = cfg.rollout
    engine = HybridEngine(
        cfg.model.path,
        startup.layout,
        roles.dims,
        roles.actor.ddp,
        engine_config=engine_config(
            cfg.model,
            cfg.data,
            r,
            cfg.trainer.seed,
            startup.rank // startup.layout.rollout_tp,
            record_routes=routing_recorded(r, roles.dims.is_moe),
        ),
        backend=r.backend,
        multi_turn=r.env is not None or r.agent is not None,
        reshard_mode=r.reshard_mode,
    )
    sampling, val_sampling = sampling_configs(cfg.rollout, cfg.trainer.seed)
    turns, runner = None, None
    if r.env is not None:
        turns = turn_limits(r)
        if engine.runs_environments:
            runner = build_env_runner(
                r, cfg.model.path, cfg.data, cfg.trainer.seed, startup.tokenizer
            )
    return Rollout(
        engine,
        sampling,
        val_sampling,
        build_actor_memory(roles, cfg.actor.param_offload),
        build_role_offload(roles, cfg.ref.param_offload, cfg.critic.param_offload),
        turns=turns,
        env_runner=runner,
        max_env_failures=r.max_env_failures,
        agent=(
            agent_source(
                r,
                cfg.data.max_prompt_length,
                startup.tokenizer,
                sampling,
                startup.pad_id,
                cfg.trainer.hang_timeout_s,
            )
            if r.agent
            else None
        ),
    )


def turn_limits(r: RolloutConfig) -> TurnLimits:
    """rollout.env's limits of a trajectory."""
    return TurnLimits(
        max_turns=r.max_turns,
        max_response_tokens=r.max_response_length,
        max_turn_tokens=r.max_turn_tokens or r.max_response_length,
    )


def build_env_runner(
    r: RolloutConfig,
    model_path: str,
    data: DataConfig,
    run_seed: int,
    tokenizer: PreTrainedTokenizerBase,
) -> EnvRunner:
    """The environments' executor on this rank: rollout.env's class, its kwargs, the template's
    deltas, and the tool pool (``run_seed``: trainer.seed)."""

    assert r.env is not None  # built for multi-turn rollouts (rollout.env) only
    # what ends a model turn: the rollout's stop tokens (the model's EOS ids) and the tokenizer's
    stop = set(eos_token_ids(model_path))
    if tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    return EnvRunner(
        check_environment(r.env, r.env_kwargs),
        r.env_kwargs,
        ChatDeltas(tokenizer),
        ToolPool(r.tool_concurrency, r.tool_timeout_s),
        run_seed=run_seed,
        stop_token_ids=stop,
        max_prompt_tokens=data.max_prompt_length,
    )


def async_rollout(cfg: RunConfig, startup: Startup, roles: Roles) -> Rollout:
    """The trainers' link to the rollout group (megarl.trainer.rollout_group)."""
    assert startup.world is not None
    itemsize = next(roles.actor.ddp.parameters()).element_size()
    plan = weight_schedule(roles.dims, startup.layout, itemsize)
    links = make_links(startup.world, plan, platform.distributed_backend())
    assert links.batches is not None
    rank = startup.rank
    sender = WeightSender(plan, rank, links.weights.get(rank))
    remote = RemoteRollout(
        plan,
        roles.dims,
        startup.layout,
        roles.actor.ddp,
        links.control,
        links.batches,
        sender,
        ep=cfg.parallel.ep,
        total_steps=cfg.trainer.total_steps,
        max_staleness=cfg.rollout.max_staleness,
    )
    sampling, val_sampling = sampling_configs(cfg.rollout, cfg.trainer.seed)
    return Rollout(remote, sampling, val_sampling, KeptActorMemory(), remote=remote)


# rollout.mode -> how the trainers reach the rollout engine
ROLLOUT_MODES = {"colocated": colocated_rollout, "async": async_rollout}


def build_rollout(cfg: RunConfig, startup: Startup, roles: Roles) -> Rollout:
    return ROLLOUT_MODES[cfg.rollout.mode](cfg, startup, roles)


def remote_data(data: DataConfig, remote: RemoteRollout) -> PolicyData:
    """An asynchronous run's prompts: the rollout group reads them, the trainers get them with
    its generations."""
    val = RemoteValidation(remote) if data.val_files else None
    return PolicyData(RemoteTrainData(remote), val, RemoteBatches(remote))


def restore(
    resumed: Resumed, data: PolicyData, kl_ctrl: KLController | None, rollout: Rollout
) -> None:
    """Put the resumed data position, KL coefficient and rollout count back (models are loaded)."""
    if not resumed.state:
        return
    if rollout.remote is not None:
        rollout.remote.restore(resumed.step, resumed.state)
    data.train.load_state_dict(resumed.state["data"])
    if kl_ctrl is not None and resumed.state["kl_ctrl"] is not None:
        kl_ctrl.load_state_dict(resumed.state["kl_ctrl"])
    rollout.engine.rollout_count = resumed.state["rollouts"]


def spec_roles(spec: AlgorithmSpec, actor: ActorConfig, reward: RewardConfig) -> list[str]:
    """The models this run builds, by role, as the start-up line names them."""
    roles = ["actor"]
    if spec.needs_reference:
        roles.append("reference (the actor's base)" if actor.lora.rank else "reference")
    if spec.needs_critic:
        roles.append("critic")
    if reward.model_path:
        roles.append("reward model")
    return roles


def role_sections(cfg: RunConfig) -> RoleSections:
    """The sections the models of ``cfg`` are built from."""
    return RoleSections(
        cfg.model,
        cfg.parallel,
        cfg.actor,
        cfg.critic,
        cfg.algorithm.distill,
        cfg.trainer,
        cfg.data.train_batch_size,
    )


def setup_run(cfg: RunConfig) -> PolicyRun:
    startup = start(cfg, with_rollout=True)
    vocab = ModelDims.from_pretrained(cfg.model.path).vocab_size
    spec = resolve_algorithm(cfg.algorithm, cfg.rollout, cfg.actor, cfg.critic, cfg.data, vocab)
    trained = {"actor": cfg.model.path}
    if spec.needs_critic:
        trained["critic"] = cfg.model.critic_path or cfg.model.path
    resume_from = resume_point(
        cfg.trainer, trained
    )  # another model or algorithm fails here, cheaply
    # tracking starts first: its writers (MLflow's process) start beside the models and engine
    step, mlflow_run_id = tracked_start(resume_from)
    tracker = Tracker(cfg, startup.rank, mlflow_run_id, start_step=step)
    if startup.world is None:
        announce(f"reading data: {', '.join(cfg.data.train_files)}")
    data = build_data(cfg.data, cfg.reward, startup) if startup.world is None else None
    announce(f"building models: {', '.join(spec_roles(spec, cfg.actor, cfg.reward))}")
    roles = build_roles(role_sections(cfg), startup.layout, spec)
    if routing_recorded(cfg.rollout, roles.dims.is_moe):  # the routers replay (or only measure)
        for model in (roles.actor.model, roles.reference):
            if model is not None:
                replay_routers(model, replay=cfg.actor.router_replay)
    options = model_options(cfg.model, cfg.parallel, cfg.actor.lora)
    rewards = build_rewards(cfg.reward, cfg.rollout, cfg.model, options, startup)
    announce(f"starting the rollout engine ({cfg.rollout.backend}, TP{startup.layout.rollout_tp})")
    rollout = build_rollout(cfg, startup, roles)
    if rollout.remote is not None:
        data = remote_data(cfg.data, rollout.remote)
    assert data is not None
    kl_ctrl = make_kl_in_reward_controller(spec)
    resumed = resume(resume_from, roles, startup.rank)
    restore(resumed, data, kl_ctrl, rollout)
    announce_steps(resumed.step, cfg.trainer.total_steps)
    return PolicyRun(
        cfg=cfg,
        startup=startup,
        spec=spec,
        roles=roles,
        rollout=rollout,
        data=data,
        rewards=rewards,
        kl_ctrl=kl_ctrl,
        batching=MicroBatching(
            cfg.actor.micro_batch_size,
            cfg.actor.max_tokens_per_micro_batch,
            cfg.actor.packing,
            cfg.actor.share_prompts,
        ),
        tracker=tracker,
        resumed=resumed,
    )
