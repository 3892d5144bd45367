"""Everything a run sets up before its first step, and the small per-step helpers of the loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megarl.config import RunConfig
from megarl.config import validate as validate_config
from megarl.errors import ConfigError
from megarl.trainer import checkpointing
from megarl.trainer.roles import Roles, build_roles
from megarl.trainer.tracking import Tracker


@dataclass
class RunState:
    cfg: RunConfig
    layout: Any
    roles: Roles
    engine: Any
    sampling: Any
    val_sampling: Any
    dataset: Any
    val_dataset: Any
    rewards: Any
    tokenizer: Any
    kl_ctrl: Any
    tracker: Tracker
    pad_id: int
    start_step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    reward_model: Any = None  # frozen reward model (reward.model_path), colocated
    _iter: Any = None

    def next_prompts(self):
        """This DP rank's next batch of prompts, starting a new epoch when one ends."""
        for _ in range(2):
            if self._iter is None:
                self._iter = iter(self.dataset)
            try:
                return next(self._iter)
            except StopIteration:
                self._iter = None
        raise ConfigError(
            "the training data yields no batch: fewer prompts than data.train_batch_size"
        )

    def mini_batches(self, samples) -> list[list[int]]:
        """Rows of each mini-batch on this rank: whole prompt groups, in rollout order."""
        dp = self.layout.dp
        per_rank_prompts = self.cfg.actor.ppo_mini_batch_size // dp
        n = self.cfg.rollout.n
        rows_per_mini = per_rank_prompts * n
        return [
            list(range(s, min(s + rows_per_mini, samples.size)))
            for s in range(0, samples.size, rows_per_mini)
        ]

    def actor_parts(self):
        a = self.roles.actor
        return a.ddp, a.optimizer, a.scheduler

    def critic_parts(self):
        c = self.roles.critic
        return c.ddp, c.optimizer, c.scheduler

    def tokens_in(self, samples) -> float:
        """Generated + trained tokens of the whole step (all DP ranks)."""
        local = float(samples.response_lens.sum() + samples.seq_lens().sum())
        return local * self.layout.dp

    def batch_metrics(self, samples, scores, batch, reward_metrics) -> dict[str, float]:
        lens = samples.response_lens.float()
        clipped = [r == "length" for r in batch.output.finish_reasons]
        out = {
            "reward/mean": float(scores.mean()),
            "reward/std": float(scores.std()) if scores.numel() > 1 else 0.0,
            "reward/max": float(scores.max()),
            "reward/min": float(scores.min()),
            "response/length_mean": float(lens.mean()),
            "response/length_max": float(lens.max()),
            "response/clip_ratio": sum(clipped) / max(len(clipped), 1),
        }
        out.update({k: float(v) for k, v in reward_metrics.items() if k not in ("reward/mean",)})
        out.update(
            {
                f"data/{k}" if "/" not in k else k: float(v)
                for k, v in self.dataset.metrics().items()
            }
        )
        return out

    def trainer_state(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "data": self.dataset.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
            "rollouts": self.engine.rollout_count,
            "mlflow_run_id": self.tracker.run_id,
            "history": self.history,
        }

    def finish(self) -> None:
        from megarl.trainer.loop import main_loop_summary

        if dist.get_rank() == 0:
            print(main_loop_summary(self.history), flush=True)
        self.tracker.close()
        self.rewards.close()


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Mean over all ranks (max for maxima, min for minima), the same dict on every rank.

    Ranks may report different keys (losses exist on the last pipeline stage only): a rank's
    missing key counts as absent, not as zero.
    """
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(metrics))
    keys = sorted(set().union(*names))
    values = torch.tensor([float(metrics.get(k, float("nan"))) for k in keys], dtype=torch.float64)
    finite = torch.isfinite(values)
    safe = torch.where(finite, values, torch.zeros_like(values))
    summed = safe.clone()
    counts = finite.double()
    maxed = torch.where(finite, values, torch.full_like(values, -float("inf")))
    mined = torch.where(finite, values, torch.full_like(values, float("inf")))
    dist.all_reduce(summed)
    dist.all_reduce(counts)
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
    dist.all_reduce(mined, op=dist.ReduceOp.MIN)
    out = {}
    for i, k in enumerate(keys):
        if k.endswith(("_max", "/max", "max")):
            out[k] = float(maxed[i])
        elif k.endswith(("_min", "/min")):
            out[k] = float(mined[i])
        else:
            out[k] = float(summed[i] / counts[i]) if counts[i] > 0 else float("nan")
    return out


def _dataset(cfg: RunConfig, files, tokenizer, batch: int, layout, seed: int, setting: str):
    from megatron.core import parallel_state as ps

    from megarl.data import PromptDataset

    return PromptDataset(
        files,
        tokenizer,
        batch_size_per_rank=batch // layout.dp,
        max_prompt_length=cfg.data.max_prompt_length,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=layout.dp,
        seed=seed,
        shuffle=cfg.data.shuffle,
        overlong_prompts=cfg.data.overlong_prompts,
        require_ground_truth=False,
        setting=setting,
    )


def check_inputs(cfg: RunConfig, layout) -> None:
    """The cheap checks: model folder, layout against it, data files; before any heavy work."""
    from megarl.data.parquet_source import inspect_files, resolve_files
    from megarl.models.dims import ModelDims

    dims = ModelDims.from_pretrained(cfg.model.path)
    layout.check_model(dims.shape)
    if cfg.model.critic_path:
        ModelDims.from_pretrained(cfg.model.critic_path)
    if cfg.reward.model_path:
        from megarl.reward_model.policy_reward import check_reward_model

        check_reward_model(cfg.reward.model_path, dims.vocab_size)
    for files, what in (
        (cfg.data.train_files, "data.train_files"),
        (cfg.data.val_files, "data.val_files"),
    ):
        if files:
            inspect_files(
                *resolve_files(files, what=what)
            )  # footers only: unreadable files fail here


def setup_run(cfg: RunConfig) -> RunState:
    from transformers import AutoTokenizer

    from megarl.algos import make_kl_controller
    from megarl.data.chat import pad_token_id
    from megarl.hybrid_engine.engine import HybridEngine
    from megarl.hybrid_engine.vllm_rollout import EngineConfig, SamplingConfig
    from megarl.launch import init_distributed
    from megarl.parallel import ParallelLayout, initialize_model_parallel
    from megarl.rewards.manager import RewardManager
    from megarl.trainer.watchdog import collective_timeout_s

    _, world = init_distributed(collective_timeout_s(cfg.trainer.hang_timeout_s))
    p = cfg.parallel
    layout = ParallelLayout.for_world(
        world,
        tp=p.tp,
        pp=p.pp,
        pp_layers=tuple(p.pp_layers) if p.pp_layers else None,
        infer_tp=p.infer_tp,
    )
    validate_config(cfg, world)
    check_inputs(cfg, layout)
    resume_from = checkpointing.resume_point(cfg)  # checked before any model is built
    initialize_model_parallel(layout, seed=cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    pad_id = pad_token_id(tokenizer) or 0
    dataset = _dataset(
        cfg,
        cfg.data.train_files,
        tokenizer,
        cfg.data.train_batch_size,
        layout,
        cfg.data.seed,
        "data.train_files",
    )
    val_dataset = None
    if cfg.data.val_files:
        val_dataset = _dataset(
            cfg,
            cfg.data.val_files,
            tokenizer,
            cfg.data.val_batch_size,
            layout,
            cfg.data.seed,
            "data.val_files",
        )
    rewards = RewardManager(
        custom_fn=cfg.reward.custom_fn,
        num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s,
        strict=cfg.reward.strict,
    )
    roles = build_roles(cfg, layout)
    reward_model = None
    if cfg.reward.model_path:
        from megarl.reward_model.policy_reward import build_reward_model
        from megarl.trainer.roles import model_options

        reward_model = build_reward_model(cfg.reward.model_path, layout, model_options(cfg))
    r = cfg.rollout
    max_len = cfg.data.max_prompt_length + r.max_response_length
    engine = HybridEngine(
        cfg.model.path,
        layout,
        roles.dims,
        roles.actor.ddp,
        roles.actor.optimizer,
        engine_config=EngineConfig(
            max_model_len=max_len,
            kv_cache_bytes=int(r.kv_cache_gib * (1 << 30)),
            dtype=cfg.model.dtype,
            seed=cfg.trainer.seed,
        ),
    )
    sampling = SamplingConfig(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_response_length,
        n=r.n,
        seed=cfg.trainer.seed,
    )
    val_sampling = SamplingConfig(
        temperature=r.val_temperature,
        max_new_tokens=r.max_response_length,
        n=1,
        seed=cfg.trainer.seed,
    )
    a = cfg.algorithm
    kl_ctrl = None
    if a.use_kl_in_reward:
        kl_kwargs = (
            {"kl_coef": a.kl_coef}
            if a.kl_ctrl == "fixed"
            else {"kl_coef": a.kl_coef, "target_kl": a.target_kl, "horizon": a.kl_horizon}
        )
        kl_ctrl = make_kl_controller(a.kl_ctrl, **kl_kwargs)
    run = RunState(
        cfg,
        layout,
        roles,
        engine,
        sampling,
        val_sampling,
        dataset,
        val_dataset,
        rewards,
        tokenizer,
        kl_ctrl,
        None,
        pad_id,
        reward_model=reward_model,
    )  # type: ignore[arg-type]
    mlflow_run = None
    path = resume_from
    if path is not None:
        state = checkpointing.load(path, roles)
        run.start_step = state["step"]
        dataset.load_state_dict(state["data"])
        if kl_ctrl is not None and state["kl_ctrl"] is not None:
            kl_ctrl.load_state_dict(state["kl_ctrl"])
        engine.rollout_count = state["rollouts"]
        run.history = list(state.get("history", []))
        mlflow_run = state.get("mlflow_run_id")
        if dist.get_rank() == 0:
            print(f"resumed from {path} at step {run.start_step}", flush=True)
    run.tracker = Tracker(cfg, dist.get_rank(), run_id=mlflow_run)
    return run


def validate(run: RunState, step: int) -> dict[str, float]:
    """Greedy rollouts on one validation batch: val/reward mean and a table of generations."""
    from megarl.trainer.experience import score_rollout
    from megarl.trainer.model_ops import MicroBatching

    if run.val_dataset is None:
        return {}
    items = next(iter(run.val_dataset))
    run.engine.to_rollout()
    batch = run.engine.generate(
        [it.input_ids for it in items], run.val_sampling, score_with_actor=False
    )
    run.engine.to_train()
    batching = MicroBatching(run.cfg.actor.micro_batch_size)
    _, scores, _, texts = score_rollout(run, items, batch, batching)
    metrics = reduce_metrics({"val/reward_mean": float(scores.mean())})
    rows = [
        {
            "step": step,
            "prompt": str(items[i].prompt)[:500],
            "response": text[:1000],
            "score": float(s),
        }
        for i, text, s in zip(batch.output.prompt_index, texts, scores.tolist(), strict=True)
    ]
    run.tracker.log_table(rows, f"validation/step_{step:06d}.json")
    return metrics
