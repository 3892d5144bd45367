"""The run assembly of ``megarl train``: small builders, each returning a frozen, typed part of
the run, and :func:`setup_run` putting them together in order (the cheap checks first).

A :class:`PolicyRun` holds what the loop needs; its parts own their state (models, the rollout
source with its data position, KL coefficient, tracker), the run object itself is never rebound.
The rollout source is built by ``rollout.placement.mode`` (:mod:`megarl.trainer.rollout_assembly`): the
colocated engine (:mod:`megarl.trainer.colocated_source`) or the link to the rollout group
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
from megarl.trainer.colocated_source import PolicyData
from megarl.trainer.experience import RewardSources
from megarl.trainer.model_ops import MicroBatching
from megarl.trainer.roles import Roles, RoleSections, build_roles
from megarl.trainer.rollout_assembly import build_rollout
from megarl.trainer.rollout_source import RolloutSource
from megarl.trainer.spec import AlgorithmSpec, make_kl_in_reward_controller, resolve_algorithm

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


@dataclass(frozen=True)
class PolicyRun:
    """The run's parts; the loop (megarl.trainer.loop.train) holds the run config itself."""

    trainer: TrainerConfig  # checkpoints (folder, retention), nan_policy, val_pass_score
    model_path: str  # the policy's folder, which its checkpoints name
    mini_batch_rows: (
        int  # rows of a mini-batch on this rank (its prompts' share x rollout.sampling.n)
    )
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
    judge_dtype = rollout_dtype(model_cfg, rollout.engine, platform.device().type == "cuda")
    return RewardSources.from_config(
        reward, model, rollout.sampling.max_response_length, judge_dtype
    )


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
    ``rollout.sampling.n`` samples each."""
    return actor.ppo_mini_batch_size // dp * rollout.sampling.n


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
    spec = resolve_algorithm(
        cfg.algorithm, cfg.rollout.sampling, cfg.actor, cfg.critic, cfg.data, vocab
    )
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
    if routing_recorded(
        cfg.rollout.engine, roles.dims.is_moe
    ):  # the routers replay (or only measure)
        for model in (roles.actor.model, roles.reference):
            if model is not None:
                replay_routers(model, replay=cfg.actor.router_replay)
    options = model_options(cfg.model, cfg.parallel, cfg.actor.lora)
    rewards = build_rewards(cfg.reward, cfg.rollout, cfg.model, options, startup)
    announce(
        f"starting the rollout engine ({cfg.rollout.engine.backend}, TP{startup.layout.rollout_tp})"
    )
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
