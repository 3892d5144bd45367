"""A trained reward model as a reward source beside the rule scorers: built colocated at the
policy's TP/PP layout, frozen, and run forward-only through the pipeline on each rollout
(prompt + response). A sequence's score is the scalar head read at its last token (as
transformers' ``*ForSequenceClassification`` reads it at the last non-pad token); the
reward-model trainer (:mod:`megarl.reward_model`) reads its scores the same way."""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.checkpoint.contained import read_pointer
from megarl.checkpoint.store import (
    LATEST_FILE,
    META_FILE,
    build_model_from_checkpoint,
    checkpoint_dims,
    read_meta,
    resolve_checkpoint,
)
from megarl.errors import ConfigError
from megarl.models.build import build_model
from megarl.models.dims import ModelDims, read_hf_config
from megarl.models.forward import broadcast_from_last_stage, run_schedule
from megarl.models.heads import hf_folder_role

_KINDS = {"actor": "causal LM", "reference": "causal LM", "critic": "value model (critic)"}


def megarl_checkpoint(path: Path) -> Path | None:
    """The reward-model checkpoint ``path`` names: a checkpoint folder, a trainer step folder
    (``step_N/reward``) or a root with ``latest`` (``OUT/checkpoints`` of `megarl train-rm`);
    None for anything else (e.g. a Hugging Face folder)."""

    for _ in range(2):
        if (path / META_FILE).is_file():
            return path
        if (path / "reward" / META_FILE).is_file():
            return path / "reward"
        name = read_pointer(path, LATEST_FILE)  # a folder inside it, or refused
        if name is None:
            return None
        path = path / name
    return None


def check_reward_model(path: str, policy_vocab_size: int) -> ModelDims:
    """Cheap checks before any process starts: the folder is a reward model of the same
    vocabulary; returns its shape."""

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
    return dims


def build_reward_model(path: str, layout, opts):
    """This rank's frozen shard of the reward model (HF folder or megarl checkpoint)."""

    folder = Path(path)
    ckpt = megarl_checkpoint(folder)
    if ckpt is not None:
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


def last_non_pad_positions(
    input_ids: torch.Tensor, seq_lens: torch.Tensor, pad_id: int | None
) -> torch.Tensor:
    """``[b]`` index of the last token of each row (within ``seq_lens``) that is not ``pad_id``,
    where transformers' ``*ForSequenceClassification`` reads its score: when the pad token is also
    the EOS token, a response ending with EOS is scored at the token before it, as there. The
    row's first position when every token is pad; ``pad_id=None``: ``seq_lens - 1``."""
    lens = seq_lens.to(input_ids.device)
    if pad_id is None:
        return lens - 1
    index = torch.arange(input_ids.shape[1], device=input_ids.device)
    real = (input_ids != pad_id) & (index < lens.unsqueeze(1))
    return (index * real).amax(dim=1)


def last_token_scores(
    output: torch.Tensor,
    seq_lens: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    pad_id: int | None = None,
) -> torch.Tensor:
    """``[b, s, 1]`` head output -> ``[b]`` scores at the last non-pad token of each row (with
    ``input_ids`` and ``pad_id``), else at ``seq_lens - 1``."""
    if input_ids is None:
        positions = seq_lens.to(output.device) - 1
    else:
        positions = last_non_pad_positions(input_ids, seq_lens, pad_id).to(output.device)
    rows = torch.arange(output.shape[0], device=output.device)
    return output[rows, positions, 0].float()


@torch.no_grad()
def score_sequences(
    model,
    input_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    micro_batch_size: int,
    pad_id: int | None = None,
    packing: bool = False,
) -> torch.Tensor:
    """``[N]`` scores of right-padded sequences (on the model's device, as ``input_ids`` must be),
    forward-only through the pipeline schedule; the same tensor on every rank of the
    model-parallel group. Collective over TP and PP. With ``packing`` each micro-batch runs as one
    pack of its sequences (:mod:`megarl.models.packing`)."""
    n = int(input_ids.shape[0])
    device = input_ids.device
    lens = seq_lens.tolist()
    order = sorted(range(n), key=lambda i: (lens[i], i))
    chunks = [order[s : s + micro_batch_size] for s in range(0, n, micro_batch_size)]
    batches = []
    for chunk in chunks:
        idx = torch.as_tensor(chunk, dtype=torch.long, device=device)
        width = max(lens[i] for i in chunk)
        batch = {"input_ids": input_ids[idx, :width], "lens": seq_lens[idx]}
        if packing:
            batch["seq_lens"] = seq_lens[idx]
        batches.append(batch)
    outs = run_schedule(
        [model],
        batches,
        lambda out, b: (
            out.sum() * 0.0,
            {"score": last_token_scores(out, b["lens"], b["input_ids"], pad_id)},
        ),
        forward_only=True,
    )
    scores = torch.zeros(n, dtype=torch.float32, device=device)
    for chunk, out in zip(chunks, outs, strict=False):  # outputs exist on the last stage only
        scores[torch.as_tensor(chunk, dtype=torch.long, device=device)] = out["score"]
    return broadcast_from_last_stage(scores)
