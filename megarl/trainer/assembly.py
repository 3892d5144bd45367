"""The run assembly of ``megarl train``: small builders, each returning a frozen, typed part of
the run, and :func:`setup_run` putting them together in order (the cheap checks first).

A :class:`PolicyRun` holds what the loop needs; its parts own their state (models, the rollout
source with its data position, KL coefficient, tracker), the run object itself is never rebound.
The rollout source is built by ``rollout.mode`` (:data:`ROLLOUT_MODES`): the colocated engine
(:mod:`megarl.trainer.colocated_source`) or the link to the rollout group
(:mod:`megarl.trainer.async_source`); the trainer sees only its protocol
(:mod:`megarl.trainer.rollout_source`).
"""

from __future__ import annotations

from dataclasses import dataclass
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
    TrainerConfig,
    rollout_dtype,
)
from megarl.config.derived import routing_recorded
from megarl.console import announce
from megarl.data import PromptDataset
from megarl.envs.chat_deltas import ChatDeltas
from megarl.envs.loading import check_environment
from megarl.envs.pool import ToolPool
from megarl.envs.runner import EnvRunner
from megarl.hybrid_engine.async_links import make_links, weight_schedule
from megarl.hybrid_engine.engine import HybridEngine
from megarl.hybrid_engine.engine_folder import eos_token_ids
from megarl.hybrid_engine.multi_turn import TurnLimits
from megarl.hybrid_engine.rollout_types import EngineConfig, SamplingConfig
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
from megarl.trainer.async_source import AsyncSource
from megarl.trainer.colocated_source import ColocatedSource, PolicyData
from megarl.trainer.experience import RewardSources
from megarl.trainer.model_ops import MicroBatching
from megarl.trainer.remote_rollout import RemoteRollout
from megarl.trainer.roles import Roles, RoleSections, build_roles
from megarl.trainer.rollout_offload import build_actor_memory, build_role_offload
from megarl.trainer.rollout_source import RolloutSource
from megarl.trainer.spec import AlgorithmSpec, make_kl_in_reward_controller, resolve_algorithm
from megarl.trainer.trajectory_makers import (
    AgentRuns,
    EnvironmentTurns,
    MultiTurnMaker,
    OneReply,
    TrajectoryMaker,
)
from megarl.weights.weight_sync import WeightSender

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class PolicyRun:
    """The run's parts; the loop (megarl.trainer.loop.train) holds the run config itself."""

    trainer: TrainerConfig  # checkpoints (folder, retention), nan_policy, val_pass_score
    model_path: str  # the policy's folder, which its checkpoints name
    mini_batch_rows: int  # rows of a mini-batch on this rank (its prompts' share x rollout.n)
    startup: Startup  # layout, rank, tokenizer
    spec: AlgorithmSpec
    roles: Roles
    rollout: RolloutSource
    rewards: RewardSources
    kl_ctrl: KLController | None
    batching: MicroBatching
    tracker: Tracker
    resumed: Resumed

    def mini_batches(self, size: int) -> list[list[int]]:
        """Rows of each mini-batch of a rollout of ``size`` rows on this rank: whole prompt
        groups, in rollout order."""
        rows = self.mini_batch_rows
        return [list(range(s, min(s + rows, size))) for s in range(0, size, rows)]

    def save_checkpoint(self, step: int, history: list[dict[str, float]]) -> Path:
        """Models, optimizers and the trainer state after ``step`` (collective); its folder."""
        kl_ctrl = self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None
        # the rollout's state: its data position, rollout count and (async) the batch in flight
        rollout = self.rollout.checkpoint_state()
        return save(
            self.trainer,
            self.model_path,
            step,
            self.roles,
            data=rollout.data,
            mlflow_run_id=self.tracker.mlflow_run_id,
            history=history,
            kl_ctrl=kl_ctrl,
            rollouts=rollout.rollouts,
            **rollout.in_flight,
        )

    def close(self) -> None:
        self.rollout.close()
        self.tracker.close()
        self.rewards.close()


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


def colocated_rollout(
    cfg: RunConfig, startup: Startup, roles: Roles, data: PolicyData | None
) -> RolloutSource:
    """The hybrid engine on the trainers' devices, generating from this DP rank's ``data``."""
    assert data is not None  # a colocated run reads its prompts on the trainers (setup_run)
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
    return ColocatedSource(
        engine,
        trajectory_maker(r, cfg.model.path, cfg.data, cfg.trainer, startup, engine, sampling),
        data,
        sampling,
        val_sampling,
        build_actor_memory(roles, cfg.actor.param_offload),
        build_role_offload(roles, cfg.ref.param_offload, cfg.critic.param_offload),
    )


def trajectory_maker(
    r: RolloutConfig,
    model_path: str,
    data: DataConfig,
    trainer: TrainerConfig,
    startup: Startup,
    engine: HybridEngine,
    sampling: SamplingConfig,
) -> TrajectoryMaker:
    """How the colocated engine makes samples: a multi-turn maker (:func:`multi_turn_maker`)
    or one reply each."""
    maker = multi_turn_maker(
        r,
        model_path,
        data,
        trainer,
        startup.tokenizer,
        startup.pad_id,
        runs_environments=engine.runs_environments,
        sampling=sampling,
    )
    return maker if maker is not None else OneReply()


def multi_turn_maker(
    r: RolloutConfig,
    model_path: str,
    data: DataConfig,
    trainer: TrainerConfig,
    tokenizer: PreTrainedTokenizerBase,
    pad_id: int,
    *,
    runs_environments: bool,
    sampling: SamplingConfig,
) -> MultiTurnMaker | None:
    """An agent's runs (``rollout.agent``; a step's agents end within a share of
    ``trainer.hang_timeout_s``), an environment's turns (``rollout.env``, seeded from
    ``trainer.seed``; its runner on the ranks that run environments), or None (one reply per
    sample). Both placements build theirs here (``sampling``: the training rollout's)."""
    if r.agent is not None:
        agent = agent_source(
            r, data.max_prompt_length, tokenizer, sampling, pad_id, trainer.hang_timeout_s
        )
        return AgentRuns(agent, r.max_env_failures)
    if r.env is not None:
        runner = (
            build_env_runner(r, model_path, data, trainer.seed, tokenizer)
            if runs_environments
            else None
        )
        return EnvironmentTurns(turn_limits(r), runner, pad_id, r.max_env_failures)
    return None


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


def async_rollout(
    cfg: RunConfig, startup: Startup, roles: Roles, data: PolicyData | None
) -> RolloutSource:
    """The trainers' link to the rollout group (megarl.trainer.rollout_group), which reads the
    prompts itself (``data``: None)."""
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
    return AsyncSource(remote, has_validation=bool(cfg.data.val_files))


# rollout.mode -> the trainer's rollout source
ROLLOUT_MODES = {"colocated": colocated_rollout, "async": async_rollout}


def build_rollout(
    cfg: RunConfig, startup: Startup, roles: Roles, data: PolicyData | None
) -> RolloutSource:
    return ROLLOUT_MODES[cfg.rollout.mode](cfg, startup, roles, data)


def restore(resumed: Resumed, kl_ctrl: KLController | None, rollout: RolloutSource) -> None:
    """Put the resumed data position, rollout count and KL coefficient back (models are
    loaded)."""
    if not resumed.state:
        return
    rollout.restore(resumed.step, resumed.state)
    if kl_ctrl is not None and resumed.state["kl_ctrl"] is not None:
        kl_ctrl.load_state_dict(resumed.state["kl_ctrl"])


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


def mini_batch_rows(actor: ActorConfig, rollout: RolloutConfig, dp: int) -> int:
    """Rows of one mini-batch on a DP rank: its share of ``actor.ppo_mini_batch_size`` prompts,
    ``rollout.n`` samples each."""
    return actor.ppo_mini_batch_size // dp * rollout.n


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
    rollout = build_rollout(cfg, startup, roles, data)
    kl_ctrl = make_kl_in_reward_controller(spec)
    resumed = resume(resume_from, roles, startup.rank)
    restore(resumed, kl_ctrl, rollout)
    announce_steps(resumed.step, cfg.trainer.total_steps)
    return PolicyRun(
        trainer=cfg.trainer,
        model_path=cfg.model.path,
        mini_batch_rows=mini_batch_rows(cfg.actor, cfg.rollout, startup.layout.dp),
        startup=startup,
        spec=spec,
        roles=roles,
        rollout=rollout,
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
