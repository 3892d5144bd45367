"""How ``megarl train`` builds the policy trainer's rollout source, by ``rollout.placement.mode``
(:data:`ROLLOUT_MODES`): the colocated hybrid engine with its prompts, sampling settings, memory
moves and trajectory maker (:mod:`megarl.trainer.colocated_source`), or the link to the
asynchronous rollout group (:mod:`megarl.trainer.async_source`); and the pieces the rollout
group's own process builds the same way (engine and sampling settings, the multi-turn maker).
Part of the run's assembly (:mod:`megarl.trainer.assembly`): these builders read the run config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl import platform
from megarl.config import (
    DataConfig,
    EnvironmentSettings,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    SamplingSettings,
    TrainerConfig,
    rollout_dtype,
)
from megarl.config.derived import routing_recorded
from megarl.envs.chat_deltas import ChatDeltas
from megarl.envs.loading import check_environment
from megarl.envs.pool import ToolPool
from megarl.envs.runner import EnvRunner
from megarl.rollout.async_links import make_links, weight_schedule
from megarl.rollout.engine import HybridEngine
from megarl.rollout.engine_folder import eos_token_ids
from megarl.rollout.multi_turn import TurnLimits
from megarl.rollout.rollout_types import EngineConfig, SamplingConfig
from megarl.run.startup import Startup
from megarl.trainer.agent_rollout import agent_source
from megarl.trainer.async_source import AsyncSource
from megarl.trainer.colocated_source import ColocatedSource, PolicyData
from megarl.trainer.remote_rollout import RemoteRollout
from megarl.trainer.roles import Roles
from megarl.trainer.rollout_offload import build_actor_memory, build_role_offload
from megarl.trainer.rollout_source import RolloutSource
from megarl.trainer.trajectory_makers import (
    AgentRuns,
    EnvironmentTurns,
    OneReply,
    TrajectoryMaker,
)
from megarl.weights.weight_sync import WeightSender

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _engine_seed(per_request_seeds: bool, run_seed: int, engine_index: int) -> int:
    """vLLM's engine seed: with per-request seeds it drives no sampling; without them each engine
    draws from its own stream (engines seeded alike would repeat each other's random numbers)."""
    if per_request_seeds:
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
        max_model_len=data.max_prompt_length + r.sampling.max_response_length,
        kv_cache_bytes=int(r.engine.kv_cache_gib * (1 << 30)),
        dtype=rollout_dtype(model, r.engine, platform.device().type == "cuda"),
        seed=_engine_seed(r.sampling.per_request_seeds, run_seed, engine_index),
        max_num_seqs=r.engine.max_num_seqs,
        gpu_memory_utilization=r.engine.gpu_memory_utilization,
        sleep_level=r.engine.sleep_level,
        record_routes=record_routes,
    )


def sampling_configs(r: SamplingSettings, run_seed: int) -> tuple[SamplingConfig, SamplingConfig]:
    """How training and validation rollouts sample (``run_seed``: trainer.seed)."""
    # rollout.sampling.ignore_eos: no stop tokens either (the model's EOS ids would still end a response)
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
            record_routes=routing_recorded(r.engine, roles.dims.is_moe),
        ),
        backend=r.engine.backend,
        multi_turn=r.env is not None or r.agent is not None,
        reshard_mode=r.engine.reshard_mode,
    )
    sampling, val_sampling = sampling_configs(r.sampling, cfg.trainer.seed)
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
) -> TrajectoryMaker | None:
    """An agent's runs (``rollout.agent``; a step's agents end within a share of
    ``trainer.hang_timeout_s``), an environment's turns (``rollout.env``, seeded from
    ``trainer.seed``; its runner on the ranks that run environments), or None (one reply per
    sample). Both placements build theirs here (``sampling``: the training rollout's)."""
    if r.agent is not None:
        agent = agent_source(
            r, data.max_prompt_length, tokenizer, sampling, pad_id, trainer.hang_timeout_s
        )
        return AgentRuns(agent, r.environment.max_env_failures)
    if r.env is not None:
        runner = (
            build_env_runner(r, model_path, data, trainer.seed, tokenizer)
            if runs_environments
            else None
        )
        limits = turn_limits(r.environment, r.sampling.max_response_length)
        return EnvironmentTurns(
            limits, runner, pad_id, r.environment.max_env_failures, r.environment.turn_loop
        )
    return None


def turn_limits(env: EnvironmentSettings, max_response_length: int) -> TurnLimits:
    """rollout.env's limits of a trajectory (``max_response_length``: all its model turns' and
    environment tokens' budget)."""
    return TurnLimits(
        max_turns=env.max_turns,
        max_response_tokens=max_response_length,
        max_turn_tokens=env.max_turn_tokens or max_response_length,
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
        ToolPool(r.environment.tool_concurrency, r.environment.tool_timeout_s),
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
        max_staleness=cfg.rollout.placement.max_staleness,
    )
    return AsyncSource(remote, has_validation=bool(cfg.data.val_files))


# rollout.placement.mode -> the trainer's rollout source
ROLLOUT_MODES = {"colocated": colocated_rollout, "async": async_rollout}


def build_rollout(
    cfg: RunConfig, startup: Startup, roles: Roles, data: PolicyData | None
) -> RolloutSource:
    return ROLLOUT_MODES[cfg.rollout.placement.mode](cfg, startup, roles, data)
