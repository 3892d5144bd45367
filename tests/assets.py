"""Test assets (built once per machine and cached): see megarl.tools.testing.assets."""

from megarl.tools.testing.assets import (  # noqa: F401
    QWEN25_SPECIAL_TOKENS,
    QWEN25_VOCAB_SIZE,
    qwen25_tokenizer_dir,
    randomize_,
    smollm2_dir,
    tiny_char_llama_dir,
    tiny_char_qwen3_moe_dir,
    tiny_chat_llama_dir,
    tiny_llama_config,
    tiny_llama_dir,
    tiny_mixtral_config,
    tiny_mixtral_dir,
    tiny_qwen2_config,
    tiny_qwen2_dir,
    tiny_qwen2_reward_dir,
    tiny_qwen3_config,
    tiny_qwen3_dir,
    tiny_qwen3_moe_config,
    tiny_qwen3_moe_dir,
    tiny_qwen3_tied_dir,
)
