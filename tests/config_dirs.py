"""Config-only Hugging Face folders: ranks build such a model unloaded and fill its weights with
random values (memory and speed do not depend on them)."""

from __future__ import annotations

import json
from pathlib import Path


def qwen2_config_dir(root: Path, name: str, vocab: int, hidden: int, ffn: int) -> Path:
    """``root/name`` holding the config.json of an untied 4-layer Qwen2 (4 query heads over 2
    key-value heads) of the given vocabulary, hidden and FFN sizes."""
    from transformers import Qwen2Config

    out = root / name
    out.mkdir(exist_ok=True)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    return out


def add_random_weights(folder: Path, seed: int = 0) -> Path:
    """Write random weights (safetensors) beside ``folder``'s config.json: the same global model
    then loads at every layout."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.tools.testing.assets import randomize_

    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(folder), dtype=torch.float32
    )
    randomize_(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
