"""The Hugging Face files a checkpoint keeps beside its weights: config, tokenizer, generation config.

A megarl checkpoint carries them in its ``hf/`` folder, so exporting it back to Hugging Face needs
nothing but the checkpoint.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path
from typing import Any

from megarl.checkpoint.contained import link_message
from megarl.errors import CheckpointError
from megarl.models.dims import ModelDims
from megarl.models.families import supported_architectures
from megarl.models.heads import (
    causal_architecture,
    has_scalar_head,
    head_architecture,
    hf_folder_role,
)

# Files copied from a Hugging Face folder: its config and everything a tokenizer may consist of.
# Weights (*.safetensors, *.bin) and anything else (optimizer states, READMEs, images) stay behind.
ASSET_PATTERNS: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
)
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer.model", "vocab.json", "*.tiktoken")


def _link_root(folder: Path) -> Path:
    """Where a Hugging Face folder's links may point: inside the folder, or for a snapshot of
    the hub's cache (``.../snapshots/<revision>``) inside that model's cache (its ``blobs/``)."""
    return folder.parent.parent if folder.parent.name == "snapshots" else folder


def asset_files(src: str | Path, skip: tuple[str, ...] = ()) -> list[Path]:
    """The config and tokenizer files of a Hugging Face folder (ASSET_PATTERNS, minus ``skip``),
    each a regular file inside the folder: a symbolic link is followed only within the folder
    (or its hub cache), else it is refused naming it (a tokenizer "file" pointing at a host file
    would be copied into an export)."""
    src = Path(src)
    root = _link_root(src).resolve()
    out = []
    for path in sorted(src.iterdir()):
        if path.name in skip or not any(fnmatch.fnmatch(path.name, p) for p in ASSET_PATTERNS):
            continue
        if path.is_symlink():
            target = path.resolve()
            if not (target.is_relative_to(root) and target.is_file()):
                raise CheckpointError(f"{src}: {link_message(src, path.name)}")
        elif not path.is_file():
            continue
        out.append(path)
    return out


def copy_hf_assets(src: str | Path, dst: str | Path) -> list[str]:
    """Copy config.json, generation config and tokenizer files from ``src`` to ``dst`` (as
    regular files; see :func:`asset_files` for links)."""
    src, dst = Path(src), Path(dst)
    files = asset_files(src)
    dst.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.copy2(path, dst / path.name)
    copied = [p.name for p in files]
    if "config.json" not in copied:
        raise CheckpointError(f"{src / 'config.json'} is missing; a Hugging Face folder needs it")
    return copied


def has_tokenizer(folder: str | Path) -> bool:
    names = [p.name for p in Path(folder).iterdir()]
    return any(fnmatch.fnmatch(n, p) for n in names for p in TOKENIZER_FILES)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is missing") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from e


def causal_lm_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config as its causal-LM architecture (a critic or reward model exported as token or
    sequence classification shares the causal LM's trunk and dimensions)."""
    archs = [causal_architecture(a) for a in cfg.get("architectures") or []]
    return {**cfg, "architectures": archs}


def hf_role(cfg: dict[str, object]) -> str:
    """``critic`` (``*ForTokenClassification``), ``reward`` (``*ForSequenceClassification``), both
    with one label, else ``actor``."""
    return hf_folder_role(cfg)


def dims_from_config(cfg: dict[str, object]) -> ModelDims:
    return ModelDims.from_hf_config(causal_lm_config(cfg))


def export_config(
    cfg: dict[str, Any], role: str, dtype_name: str, pad_token_id: int | None = None
) -> dict[str, Any]:
    """config.json of an exported model: causal LM (actor, reference), token classification
    (critic) or sequence classification (reward) with one label, in ``dtype_name``.

    A sequence classifier in transformers reads each row at its last non-pad token, so a reward
    model's config gets ``pad_token_id`` (from the tokenizer when the config has none).
    """
    out = causal_lm_config(cfg)
    archs = out.get("architectures") or []
    known = [a for a in archs if a in supported_architectures()]
    if role == "reward" and out.get("pad_token_id") is None and pad_token_id is not None:
        out["pad_token_id"] = pad_token_id
    if has_scalar_head(role):
        out["architectures"] = [head_architecture(a, role) for a in known]
        out["id2label"] = {"0": "LABEL_0"}
        out["label2id"] = {"LABEL_0": 0}
        out.pop("num_labels", None)
    else:
        out.pop("id2label", None)
        out.pop("label2id", None)
    # transformers 5 writes "dtype", 4.x "torch_dtype"; set whichever the file uses.
    keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["torch_dtype"]
    for key in keys:
        out[key] = dtype_name
    return out
