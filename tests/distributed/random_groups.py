"""Random GRPO-shaped batches for the rank-side test bodies: whole prompt groups with prompts
and responses of different lengths, the same on every rank (seeded)."""

from __future__ import annotations

import torch

from megarl.trainer.batch import Samples


def random_group_samples(
    vocab: int, prompts: int, n: int, max_response: int, seed: int
) -> tuple[Samples, torch.Generator]:
    """`prompts` prompts of 3-6 tokens, each with `n` responses of 1..`max_response` tokens.
    Returns the generator too, so that callers draw their extra tensors from the same stream."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = [
        torch.randint(1, vocab, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen)
        for _ in range(prompts)
    ]
    seq_prompts, responses, groups = [], [], []
    for p in range(prompts):
        for _ in range(n):
            length = int(torch.randint(1, max_response + 1, (1,), generator=gen))
            responses.append(torch.randint(1, vocab, (length,), generator=gen).tolist())
            seq_prompts.append(prompt_ids[p].tolist())
            groups.append(p)
    return Samples.from_sequences(seq_prompts, responses, groups, pad_id=0, device="cpu"), gen
