"""A trained reward model inside PPO/GRPO: built colocated at the policy's TP/PP layout, frozen,
and run forward-only through the pipeline on each rollout (prompt + response)."""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.errors import ConfigError

_KINDS = {"actor": "causal LM", "reference": "causal LM", "critic": "value model (critic)"}


def megarl_checkpoint(path: Path) -> Path | None:
    """The reward-model checkpoint ``path`` names: a checkpoint folder, a trainer step folder
    (``step_N/reward``) or a root with ``latest`` (``OUT/checkpoints`` of `megarl train-rm`);
    None for anything else (e.g. a Hugging Face folder)."""
    from megarl.checkpoint.store import LATEST_FILE, META_FILE

    for _ in range(2):
        if (path / META_FILE).is_file():
            return path
        if (path / "reward" / META_FILE).is_file():
            return path / "reward"
        if not (path / LATEST_FILE).is_file():
            return None
        path = path / (path / LATEST_FILE).read_text().strip()
    return None


def check_reward_model(path: str, policy_vocab_size: int) -> None:
    """Cheap checks before any process starts: the folder is a reward model of the same vocabulary."""
    from megarl.checkpoint.store import checkpoint_dims, read_meta, resolve_checkpoint
    from megarl.models.dims import ModelDims, read_hf_config
    from megarl.models.heads import hf_folder_role

    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(
            f"reward.model_path={path} does not exist; train one with `megarl train-rm` and pass "
            "its checkpoint folder, or an exported *ForSequenceClassification folder"
        )
    ckpt = megarl_checkpoint(folder)
    if ckpt is not None:
        ckpt = resolve_checkpoint(ckpt)
        role, dims = read_meta(ckpt).role, checkpoint_dims(ckpt)
    else:
        cfg = read_hf_config(folder)
        role, dims = hf_folder_role(cfg), ModelDims.from_hf_config(cfg)
    if role != "reward":
        raise ConfigError(
            f"reward.model_path={path} is a {_KINDS.get(role, role)}, not a reward model (a one-label "
            "*ForSequenceClassification, or a `megarl train-rm` checkpoint)"
        )
    if dims.vocab_size != policy_vocab_size:
        raise ConfigError(
            f"reward.model_path={path} has a vocabulary of {dims.vocab_size} tokens, the policy "
            f"{policy_vocab_size}; the reward model reads the policy's token ids, so it must share "
            "its tokenizer"
        )


def build_reward_model(path: str, layout, opts):
    """This rank's frozen shard of the reward model (HF folder or megarl checkpoint)."""
    from megarl.models.build import build_model

    folder = Path(path)
    ckpt = megarl_checkpoint(folder)
    if ckpt is not None:
        from megarl.checkpoint.store import build_model_from_checkpoint

        model, _, _ = build_model_from_checkpoint(ckpt, layout, role="reward", opts=opts)
    else:
        model, _ = build_model(folder, layout, "reward", opts)
    model.requires_grad_(False)
    model.eval()
    return model


def combine_scores(
    rule: torch.Tensor, model: torch.Tensor | None, rule_weight: float, model_weight: float
) -> torch.Tensor:
    """``rule_weight * rule + model_weight * model`` (the model term only when there is one)."""
    out = rule_weight * rule
    if model is not None:
        out = out + model_weight * model
    return out
