"""The cheap checks of a run's inputs (model folders, layout, data files), made before launch by
the CLI and again on every rank before any heavy work, and of the words a config's field types
cannot check (loggers, algorithm names: :func:`check_choices`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megarl.agents.loading import load_agent
from megarl.algos.choices import resolve_algorithm_kwargs, resolve_dpo_loss
from megarl.backends import check_backends, rollout_backend
from megarl.checkpoint.hf_assets import has_tokenizer
from megarl.config import (
    ActorConfig,
    AlgorithmConfig,
    DPOConfig,
    JudgeConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
)
from megarl.data.parquet_source import distinct_strings, inspect_files, resolve_files
from megarl.data.preference_dataset import check_preference_files
from megarl.data.prompt_dataset import check_prompt_files
from megarl.data.schema import REWARD_MODEL, STRING, check_columns
from megarl.data.sft_dataset import check_sft_files
from megarl.data.tokenizers import tokenizer_difference
from megarl.envs.loading import check_environment
from megarl.errors import ConfigError, MegarlError
from megarl.import_paths import check_import_path
from megarl.loggers import check_loggers
from megarl.models.dims import ModelDims, read_hf_config
from megarl.models.heads import hf_folder_role
from megarl.parallel import ParallelLayout
from megarl.rewards.judge_prompt import JudgeTemplate
from megarl.rewards.model import check_reward_model
from megarl.rewards.registry import BUILTIN_SCORERS
from megarl.rewards.remote_settings import RemoteSettings
from megarl.weights.reshard_mode import shard_refusal

if TYPE_CHECKING:
    from megarl.data.parquet_source import ParquetFileInfo


# Settings that name Python code, with the keyword arguments megarl calls it with: each is
# imported and checked (check_import_path) before any model is built. Add yours here.
IMPORT_SETTINGS: dict[str, tuple[str, ...]] = {
    "reward.custom_fn": ("data_source", "solution_str", "ground_truth", "extra_info"),
}


@dataclass(frozen=True)
class AlgorithmWords:
    """The sections whose words name algorithms (the trainer kind's check reads its own)."""

    algorithm: AlgorithmConfig  # a policy run's: with rollout (rollout_correction's settings)
    rollout: RolloutConfig
    dpo: DPOConfig  # a DPO run's loss


def _check_policy_words(words: AlgorithmWords) -> None:
    resolve_algorithm_kwargs(words.algorithm, words.rollout.sampling, try_them=True)


def _check_dpo_words(words: AlgorithmWords) -> None:
    resolve_dpo_loss(words.dpo, try_it=True)


# trainer.kind -> the check of its algorithm words (the reward-model and SFT trainers have none)
_ALGORITHM_CHECKS: dict[str, Callable[[AlgorithmWords], None]] = {
    "policy": _check_policy_words,
    "dpo": _check_dpo_words,
}


def check_agent_setting(spec: str) -> None:
    """Load ``rollout.agent``: a ConfigError naming the fix when it cannot be used (before any
    model is built)."""
    load_agent(spec)


def check_choices(cfg: RunConfig) -> None:
    """The config's words chosen from registries: ``trainer.loggers`` and the trainer's algorithm
    words (each lists the known names); the CLI runs this right after loading the config."""
    check_loggers(cfg.trainer.loggers, cfg.trainer.mlflow_tracking_uri)
    check_algorithm = _ALGORITHM_CHECKS.get(cfg.trainer.kind)
    if check_algorithm is not None:
        check_algorithm(AlgorithmWords(cfg.algorithm, cfg.rollout, cfg.dpo))


def setting_value(config: object, key: str) -> object:
    """The value of a dotted config key (``reward.custom_fn``) in ``config`` (a run config or
    any of its sections)."""
    value: object = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def check_import_settings(cfg: RunConfig) -> None:
    """Import every path of :data:`IMPORT_SETTINGS` that ``cfg`` sets, and check its signature."""
    for key, keywords in IMPORT_SETTINGS.items():
        spec = setting_value(cfg, key)
        if spec:
            check_import_path(key, str(spec), keywords)


def rules_need_ground_truth(reward: RewardConfig) -> bool:
    """Whether the run's rule scorers read each prompt's ``reward_model.ground_truth``: the
    built-in scorers do; a ``reward.custom_fn`` gets it if present; a reward model alone never."""
    return reward.rule_weight != 0 and reward.custom_fn is None


def check_reward_columns(
    kind: str, reward: RewardConfig, files: list[ParquetFileInfo], fs, what: str
) -> None:
    """The prompt files carry what the chosen scorers need (a ``kind`` of trainer.kind): with
    the built-in scorers, verl's ``reward_model`` column (with ``ground_truth``) and only data
    sources they know."""
    if kind != "policy" or not rules_need_ground_truth(reward):
        return

    why = (
        "The built-in rule scorers read each prompt's reward_model.ground_truth (no "
        "reward.custom_fn is set). Add the column (python scripts/prepare_gsm8k.py writes it), "
        "set reward.custom_fn to your scorer, or score with a reward model or a remote reward "
        "service alone (reward.model_path=... or reward.remote_url=..., reward.rule_weight=0)."
    )
    for info in files:
        check_columns(info, {"data_source": STRING, "reward_model": REWARD_MODEL}, hint=why)
        unknown = sorted(distinct_strings(fs, info, "data_source") - set(BUILTIN_SCORERS))
        if unknown:
            raise ConfigError(
                f"{what}: {info.path} has prompts of data_source {unknown[:5]}, which no built-in "
                f"scorer scores (they score {sorted(BUILTIN_SCORERS)}); set reward.custom_fn to a "
                "scorer for them, or score with a reward model or a remote reward service alone "
                "(reward.model_path=... or reward.remote_url=..., reward.rule_weight=0)"
            )


def check_inputs(
    cfg: RunConfig, layout: ParallelLayout, this_machine: bool = True
) -> ModelDims | None:
    """Every import path the config names, backends (``this_machine``: the run starts here),
    model folder, layout against it, reward model, rollout.env, data files (footers only), their
    columns for the trainer's kind and the reward columns of the prompts, the companion models
    (DPO reference, distillation teacher), and (``this_machine``) that the remote reward service
    answers; returns the reward model's shape (None: none)."""

    check_import_settings(cfg)  # before anything slow: a typo costs seconds
    if this_machine:
        # vLLM / Transformer Engine where the config asks for them
        backend = rollout_backend(cfg.trainer.kind, cfg.rollout.engine.backend)
        check_backends(cfg.model, cfg.actor, cfg.parallel, backend)
    dims = ModelDims.from_pretrained(cfg.model.path)
    layout.check_model(dims.shape)
    if cfg.rollout.placement.mode == "async":  # the rollout group's engines: infer_tp ranks each
        p = cfg.parallel
        ParallelLayout(dp=p.rollout_ranks, infer_tp=p.infer_tp or p.tp).check_model(dims.shape)
    _check_moe_options(cfg.model, cfg.rollout, cfg.actor, dims)
    if cfg.model.critic_path:
        ModelDims.from_pretrained(cfg.model.critic_path)
    reward_model = None
    if cfg.reward.model_path:
        reward_model = check_reward_model(cfg.reward.model_path, dims.vocab_size)
    if cfg.rollout.env is not None:
        check_environment(cfg.rollout.env, cfg.rollout.env_kwargs)
    if cfg.rollout.agent is not None:
        check_agent_setting(cfg.rollout.agent)
    check_columns = _COLUMN_CHECKS[cfg.trainer.kind]
    for files, what in (
        (cfg.data.train_files, "data.train_files"),
        (cfg.data.val_files, "data.val_files"),
    ):
        if files:  # unreadable files, missing columns and unscored data sources fail here
            fs, paths = resolve_files(files, what=what)
            infos = inspect_files(fs, paths)
            check_columns(infos)
            check_reward_columns(cfg.trainer.kind, cfg.reward, infos, fs, what)
    companion = _COMPANIONS.get(cfg.trainer.kind)
    if companion is not None:
        setting, what = companion
        path = setting_value(cfg, setting)
        if path:
            _check_companion(
                cfg.model.path, cfg.parallel.pp_layers, layout, dims, str(path), setting, what
            )
    if cfg.trainer.kind == "policy":
        check_judge(cfg.reward.judge, this_machine)
    if this_machine and cfg.trainer.kind == "policy":
        check_remote_reward(cfg.reward)
    return reward_model


def check_judge(j: JudgeConfig, this_machine: bool) -> ModelDims | None:
    """``reward.judge``: its template and score pattern; a local judge's folder is an HF causal
    LM with a tokenizer (returns its shape); a server's (``this_machine``) lists the judge's
    model. None without a local judge."""
    if j.model_path is None and j.url is None:
        return None
    JudgeTemplate.from_config(j)
    if j.url is not None:
        if this_machine:
            from megarl.rewards.judge_remote import OpenAIJudge  # the openai client

            OpenAIJudge(j).check_reachable()
        return None
    assert j.model_path is not None
    config = read_hf_config(j.model_path)
    role = hf_folder_role(config)
    if role != "actor":
        raise ConfigError(
            f"reward.judge.model_path={j.model_path} is a {role} model; a judge "
            "writes its verdict, so give a causal LM folder (*ForCausalLM); score with a reward "
            "model through reward.model_path"
        )
    if not has_tokenizer(j.model_path):
        raise ConfigError(
            f"reward.judge.model_path={j.model_path} has no tokenizer (tokenizer.json or "
            "tokenizer_config.json); the judge reads text, so its folder needs one"
        )
    return ModelDims.from_hf_config(config)


def check_remote_reward(reward: RewardConfig) -> None:
    """The service of ``reward.remote_url`` answers an empty batch (after its retries); a
    ConfigError naming the URL and the error otherwise."""
    settings = RemoteSettings.from_config(reward)
    if settings is None:
        return
    from megarl.rewards.remote import RemoteScorer  # aiohttp: only for a remote reward

    RemoteScorer(settings).check_reachable()


# trainer.kind -> the frozen model of another folder that reads the policy's token ids, when
# its setting is set: (setting, what)
_COMPANIONS: dict[str, tuple[str, str]] = {
    "dpo": ("dpo.reference_path", "reference"),
    "policy": ("algorithm.distill.teacher_path", "teacher"),
}


def _check_prompts(infos: list[ParquetFileInfo]) -> None:

    check_prompt_files(infos, require_ground_truth=False)  # rewards may come from a model


def _check_preferences(infos: list[ParquetFileInfo]) -> None:

    check_preference_files(infos)


def _check_sft(infos: list[ParquetFileInfo]) -> None:

    check_sft_files(infos)


# trainer.kind -> the column check of its data files
_COLUMN_CHECKS: dict[str, Callable[[list[ParquetFileInfo]], None]] = {
    "policy": _check_prompts,
    "reward_model": _check_preferences,
    "dpo": _check_preferences,
    "sft": _check_sft,
}


def _check_companion(
    model_path: str,
    pp_layers: list[int] | None,
    layout: ParallelLayout,
    dims: ModelDims,
    path: str,
    setting: str,
    what: str,
) -> None:
    """A frozen model that reads the policy's token ids (DPO reference, distillation teacher): a
    causal LM of the same tokenizer as ``model_path`` (the policy) that fits the layout
    (``pp_layers``: parallel.pp_layers)."""

    try:
        hf_cfg = read_hf_config(path)
    except MegarlError as e:
        raise ConfigError(f"{setting}: {e}") from None
    if hf_folder_role(hf_cfg) != "actor":
        raise ConfigError(
            f"{setting}={path} is not a causal language model (its architectures: "
            f"{hf_cfg.get('architectures')}); the {what} must be a *ForCausalLM folder"
        )
    theirs = ModelDims.from_hf_config(hf_cfg)
    try:
        layout.check_model(theirs.shape)
    except MegarlError as e:
        raise ConfigError(
            f"{setting}={path} does not fit the layout the {what} shares with the policy: {e}"
        ) from None
    if pp_layers and theirs.num_layers != dims.num_layers:
        raise ConfigError(
            f"parallel.pp_layers splits the policy's {dims.num_layers} layers; the {what} "
            f"({setting}) has {theirs.num_layers}: remove parallel.pp_layers (an even split fits both)"
        )
    difference = tokenizer_difference(model_path, path)
    if difference is not None:
        raise ConfigError(
            f"{setting}={path} has another tokenizer than model.path={model_path} "
            f"({difference}); the {what} scores the policy's token ids, so both must share one "
            "tokenizer"
        )
    if theirs.vocab_size < dims.vocab_size:
        raise ConfigError(
            f"{setting}={path} has an output vocabulary of {theirs.vocab_size} ids, fewer than "
            f"the policy's {dims.vocab_size}; it could not score every id the policy can write"
        )


def _check_router_replay(
    model_path: str, r: RolloutConfig, actor: ActorConfig, dims: ModelDims
) -> None:
    """actor.router_replay: an MoE policy, on the paths that carry the rollout's routing."""
    if not dims.is_moe:
        raise ConfigError(
            f"actor.router_replay=true replays a mixture-of-experts routing; {model_path} is a "
            f"dense {dims.family} model: set actor.router_replay=false"
        )
    if r.engine.backend != "hf":
        raise ConfigError(
            f"actor.router_replay=true with rollout.engine.backend={r.engine.backend}: megarl does not read "
            "vLLM's routed experts yet (vLLM 0.32 returns them only from its V2 model runner, "
            "which its CPU build starts only with Triton's CPU backend); set rollout.engine.backend=hf "
            "(transformers records its routers' choices)"
        )


def _check_moe_options(
    model: ModelConfig, rollout: RolloutConfig, actor: ActorConfig, dims: ModelDims
) -> None:
    """Router-loss settings need a mixture-of-experts model; LoRA needs a dense one; vLLM takes
    no pre-sharded experts."""

    set_ = [n for n in ("moe_aux_loss_coeff", "moe_z_loss_coeff") if getattr(model, n)]
    if set_ and not dims.is_moe:
        raise ConfigError(
            f"model.{set_[0]}={getattr(model, set_[0])} applies to mixture-of-experts models; "
            f"{model.path} is a dense {dims.family} model: remove it (or set it to 0)"
        )
    refusal = shard_refusal(rollout.engine.backend, dims.is_moe)
    if rollout.engine.reshard_mode == "shard" and refusal:
        raise ConfigError(
            f"rollout.engine.reshard_mode=shard with rollout.engine.backend={rollout.engine.backend} and the "
            f"mixture-of-experts model {model.path}: {refusal}; set rollout.engine.reshard_mode=auto "
            "(full for this model) or rollout.engine.backend=hf"
        )
    if actor.router_replay:
        _check_router_replay(model.path, rollout, actor, dims)
    if actor.lora.rank and dims.is_moe:
        raise ConfigError(
            f"actor.lora.rank={actor.lora.rank}: LoRA adapters are built for dense models only "
            f"and {model.path} is a mixture-of-experts {dims.family} model: set "
            "actor.lora.rank=0 (full fine-tuning)"
        )
