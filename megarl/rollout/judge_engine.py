"""A generative judge run here (``reward.judge.model_path``): an HF causal-LM folder generating
with the HF rollout engine (:class:`~megarl.rollout.hf_rollout.HFRollout`), greedily.

Each rank holds a replica and judges its own samples; nothing crosses ranks. Between scorings
the engine sleeps: on a GPU its weights wait in host memory (sleep level 1) and come back only
while it answers, so the rollout and the update have the device to themselves. A prompt is one
user message through the judge's chat template (plain text when its tokenizer has none); text in
a prompt or response never becomes the template's control tokens (megarl.data.literal_text).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from megarl.config import JudgeConfig
from megarl.data.chat import encode_prompts
from megarl.rewards.judge import NoAnswer
from megarl.rollout.hf_rollout import HFRollout
from megarl.rollout.rollout_types import EngineConfig, SamplingConfig


class EngineJudge:
    """Answers from the model at ``model_dir``; see the module docstring."""

    def __init__(self, model_dir: str | Path, settings: JudgeConfig, dtype: str) -> None:
        from transformers import AutoTokenizer

        self.model_dir = str(model_dir)
        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        config = EngineConfig(max_model_len=settings.max_length, dtype=dtype, sleep_level=1)
        self.engine = HFRollout(self.model_dir, 1, config)
        self.sampling = SamplingConfig(temperature=0.0, max_new_tokens=settings.max_tokens)
        self.engine.sleep()

    @property
    def name(self) -> str:
        return f"the judge reward.judge.model_path={self.model_dir}"

    def _encode(self, prompts: Sequence[str]) -> list[list[int]]:
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        return encode_prompts(self.tokenizer, list(prompts), apply_chat_template=templated)

    def answer(self, prompts: Sequence[str]) -> list[str | NoAnswer]:
        ids = self._encode(prompts)
        limit = self.settings.max_length - self.settings.max_tokens
        out: list[str | NoAnswer] = [
            NoAnswer(
                "error",
                f"the judge's prompt has {len(x)} tokens, more than reward.judge.max_length="
                f"{self.settings.max_length} - reward.judge.max_tokens="
                f"{self.settings.max_tokens} leaves; raise reward.judge.max_length or shorten "
                "reward.judge.template",
            )
            for x in ids
        ]
        fits = [i for i, x in enumerate(ids) if len(x) <= limit]
        if not fits:
            return out
        self.engine.wake_up()
        try:
            generated = self.engine.generate([ids[i] for i in fits], self.sampling)
        finally:
            self.engine.sleep()
        texts = self.tokenizer.batch_decode(generated.token_ids, skip_special_tokens=True)
        for i, text in zip(fits, texts, strict=True):
            out[i] = text
        return out
