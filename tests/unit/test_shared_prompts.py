"""Shared-prompt packs (actor.share_prompts): layout, positions, masks and the micro-batch order.

The model-level parity (logprobs, loss, grads and values against plain packs at TP2xPP2 with
sequence parallelism) is in tests/distributed/test_packing_parity.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megarl.models.shared_prompts import (
    check_supported,
    pack_shared_prompts,
    shared_sources,
    shared_values,
)
from megarl.trainer.batch import Samples, micro_batches

PROMPT_A, PROMPT_B = [5, 6, 7], [8, 9]
ROWS = [  # (prompt, response): group A has an empty response; rows of A and B interleaved
    (PROMPT_A, [1, 2]),
    (PROMPT_B, [4, 4, 4]),
    (PROMPT_A, [3]),
    (PROMPT_A, []),
]


def _padded(rows):
    lens = [len(p) + len(r) for p, r in rows]
    ids = torch.tensor(
        [[*p, *r] + [0] * (max(lens) - n) for (p, r), n in zip(rows, lens, strict=True)]
    )
    return ids, torch.tensor([len(p) for p, _ in rows]), torch.tensor(lens)


def test_each_prompt_once_then_its_responses_with_continuing_positions():
    ids, plens, lens = _padded(ROWS)
    pack = pack_shared_prompts(ids, plens, lens, multiple=4)
    assert pack.input_ids[0].tolist() == [5, 6, 7, 1, 2, 3, 8, 9, 4, 4, 4, 0]
    assert pack.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 4, 0]
    assert pack.cu_seqlens.tolist() == [0, 6, 11, 12]  # group A, group B, the pad tail
    assert pack.num_tokens == 12 and pack.max_seqlen == 6
    # a plain pack of these rows holds 5 + 5 + 4 + 3 = 17 tokens; each prompt once: 11 + a pad


def test_every_position_of_every_row_reads_its_own_token_at_its_own_rotary_position():
    ids, plens, lens = _padded(ROWS)
    pack = pack_shared_prompts(ids, plens, lens)
    width = ids.shape[1] + 3  # past the rows' ends too
    positions = torch.arange(width).unsqueeze(0).expand(len(ROWS), -1)
    index = pack.index(positions)
    for r, n in enumerate(lens.tolist()):
        for p in range(width):
            q = min(p, n - 1)  # past its end a row reads its last token, as plain packing does
            assert int(pack.input_ids[0, index[r, p]]) == int(ids[r, q]), (r, p)
            assert int(pack.position_ids[0, index[r, p]]) == q, (r, p)


def test_per_token_values_and_sources_follow_the_pack():
    """Routing replay's layout of the rows' per-token values (recorded experts) over the pack: a
    shared prompt's from its group's first row, each response's from its row, the pad tail
    filled; and each pack token's flat positions in the padded rows, a prompt token's one per
    row of its group."""
    ids, plens, lens = _padded(ROWS)
    pack = pack_shared_prompts(ids, plens, lens, multiple=4)
    width = ids.shape[1]
    flat = torch.arange(len(ROWS) * width).reshape(len(ROWS), width)
    values = shared_values(pack, flat.unsqueeze(-1), fill=-1)[:, 0]
    # row 0 is group A's first: its prompt; rows 0 and 2 respond; then B (row 1); the pad tail
    assert values.tolist() == [0, 1, 2, 3, 4, 13, 5, 6, 7, 8, 9, -1]
    sources = shared_sources(pack, width)
    assert sources.shape == (12, 3)  # group A has 3 rows
    assert sources[:3].tolist() == [[0, 10, 15], [1, 11, 16], [2, 12, 17]]  # rows 0, 2, 3
    assert sources[3:].tolist() == [
        [3, -1, -1],
        [4, -1, -1],
        [13, -1, -1],
        [5, -1, -1],  # group B, row 1, width 5: its prompt then its response
        [6, -1, -1],
        [7, -1, -1],
        [8, -1, -1],
        [9, -1, -1],
        [-1, -1, -1],
    ]


def test_masks_let_a_response_see_the_prompt_and_itself_only():
    ids, plens, lens = _padded(ROWS)
    pack = pack_shared_prompts(ids, plens, lens)
    mask_a, mask_b = pack.masks
    assert mask_b is None  # one sample: plain causal attention
    # group A's segment: prompt 0-2, row 0's response 3-4, row 2's response 5
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        for j in range(i + 1):
            block_i = 0 if 3 <= i <= 4 else 1 if i == 5 else -1
            block_j = 0 if 3 <= j <= 4 else 1 if j == 5 else -1
            expected[i, j] = block_j == -1 or block_j == block_i
    assert torch.equal(mask_a, expected)


def test_masked_attention_over_a_pack_equals_attention_over_each_row():
    """The attention the core attention computes on a shared pack, against causal attention of
    each row alone, at the positions the loss reads (random q/k/v per token and position)."""
    gen = torch.Generator().manual_seed(0)
    vocab, heads, dim = 10, 2, 4
    table = torch.randn(vocab, 12, 3, heads, dim, generator=gen)  # token x position -> q, k, v

    def qkv(tokens, positions):
        t = table[tokens, positions]  # [n, 3, heads, dim]
        return (t[:, i].transpose(0, 1) for i in range(3))

    ids, plens, lens = _padded(ROWS)
    pack = pack_shared_prompts(ids, plens, lens)
    bounds = pack.cu_seqlens.tolist()
    pieces = []
    for s, mask in enumerate(pack.masks):
        seg = slice(bounds[s], bounds[s + 1])
        q, k, v = qkv(pack.input_ids[0, seg], pack.position_ids[0, seg])
        pieces.append(
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        )
    packed_out = torch.cat(pieces, dim=1)  # [heads, T, dim]
    index = pack.index(torch.arange(ids.shape[1]).unsqueeze(0).expand(len(ROWS), -1))
    for r, n in enumerate(lens.tolist()):
        q, k, v = qkv(ids[r, :n], torch.arange(n))
        alone = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(packed_out[:, index[r, :n]], alone, rtol=1e-6, atol=1e-6)


def test_rows_must_hold_their_prompt():
    ids, plens, lens = _padded(ROWS)
    with pytest.raises(ValueError, match="prompt length <= sequence length"):
        pack_shared_prompts(ids, plens + 10, lens)


def test_micro_batches_keep_each_prompt_group_together():
    prompts, responses, groups = [], [], []
    for g, sizes in enumerate([[9, 1, 5], [2, 3], [7, 8, 4]]):
        for n in sizes:
            prompts.append([g + 1] * 3)
            responses.append([1] * n)
            groups.append(g)
    samples = Samples.from_sequences(prompts, responses, groups, 0, "cpu")
    together = micro_batches(samples, range(samples.size), 3, groups_together=True)
    assert [[groups[r] for r in rows] for rows, _ in together] == [[0, 0, 0], [1, 1, 2], [2, 2]]
    by_length = micro_batches(samples, range(samples.size), 3)
    assert [[groups[r] for r in rows] for rows, _ in by_length] == [[0, 1, 1], [2, 0, 2], [2, 0]]


def test_a_model_without_megarls_sdpa_attention_is_refused_naming_the_setting():
    with pytest.raises(
        ValueError, match=r"needs megarl's SDPA core attention.*share_prompts=false"
    ):
        check_supported(torch.nn.Sequential(torch.nn.Linear(2, 2)))
