"""Shared-prompt packing: the samples of one prompt run through the model with the prompt once.

GRPO draws ``n`` responses per prompt, and each sample is ``prompt + response``: a micro-batch of
``n`` samples of one prompt puts its prompt through every layer ``n`` times, forward and backward,
although the prompt's activations are the same each time (same tokens, same weights, causal
attention: a prompt token never sees a response). With prompts of 100 tokens and answers of 12,
nine tenths of a step's tokens are repeated prompt tokens.

Here every group of rows with the same prompt tokens becomes one segment of the pack: the prompt,
then each response after it. Inside a segment a token attends causally to the prompt and to its
own response, never to another response (a boolean mask per segment, which
:class:`megarl.models.attention.SDPACoreAttention` reads from the ``PackedSeqParams``), and each
response's rotary positions continue from the prompt's end as if it stood alone (megatron's THD
rope takes per-token frequencies when there are as many as tokens; :func:`rotary_positions`
indexes the model's table by the pack's positions). The loss sees the outputs at each row's
positions (:meth:`SharedPromptPack.index`), the first response token of every sample predicted
from the one shared last prompt token. The forward values are those of the per-sample pack; the
gradients reaching the prompt are the sum over the samples, which is what autograd gives the
per-sample pack too: the same maths with fewer tokens, equal up to float rounding.

Needs rope position embeddings and megarl's SDPA core attention (the CPU layer spec):
Transformer Engine's fused attention reads ``cu_seqlens`` only and could not take the masks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megarl.models.packing import thd_params

# The pack's per-token positions ([T]) while a shared-prompt pack runs forward; None otherwise.
_POSITIONS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "megarl_shared_prompt_positions", default=None
)
_HOOKED: set[int] = set()  # id() of the rotary modules carrying the hook
_CHECKED: set[int] = set()  # id() of the models found able to run a shared-prompt pack


@dataclass(frozen=True)
class SharedPromptPack:
    input_ids: torch.Tensor  # [1, T]: per group its prompt then its responses; a pad tail
    position_ids: torch.Tensor  # [1, T]: prompt 0 .. P-1, each response P .. P+len-1
    cu_seqlens: torch.Tensor  # [segments + 1] int32: one segment per group, then the pad tail
    max_seqlen: int
    masks: tuple[torch.Tensor | None, ...]  # per segment [len, len] bool (True: may attend)
    prompt_offsets: torch.Tensor  # [b] where each row's prompt starts in the pack
    prompt_lens: torch.Tensor  # [b]
    response_offsets: torch.Tensor  # [b] where each row's response starts in the pack
    response_lens: torch.Tensor  # [b]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def seq_params(self):
        """megatron's ``PackedSeqParams`` (THD), carrying the segments' masks."""
        params = thd_params(self.cu_seqlens, self.max_seqlen)
        params.segment_masks = self.masks
        return params

    def index(self, positions: torch.Tensor) -> torch.Tensor:
        """``[b, P]`` positions of the padded rows (prompt + response) as indices into the pack.

        As :func:`megarl.models.packing.packed_positions`, a position past its row's end reads
        the row's last token (its response's, or its prompt's when the response is empty)."""
        device = positions.device
        plen = self.prompt_lens.to(device).unsqueeze(1)
        rlen = self.response_lens.to(device).unsqueeze(1)
        in_prompt = self.prompt_offsets.to(device).unsqueeze(1) + torch.minimum(positions, plen - 1)
        into_response = torch.minimum((positions - plen).clamp(min=0), (rlen - 1).clamp(min=0))
        in_response = self.response_offsets.to(device).unsqueeze(1) + into_response
        return torch.where((positions >= plen) & (rlen > 0), in_response, in_prompt)


def _segment_mask(prompt_len: int, response_lens: list[int], device: torch.device) -> torch.Tensor:
    """``[S, S]`` causal attention within one group's segment, responses blind to each other."""
    block = torch.tensor(
        [-1] * prompt_len + [k for k, n in enumerate(response_lens) for _ in range(n)],
        device=device,
    )
    size = int(block.numel())
    causal = torch.ones(size, size, dtype=torch.bool, device=device).tril()
    visible = (block.unsqueeze(0) == -1) | (block.unsqueeze(0) == block.unsqueeze(1))
    return causal & visible


def pack_shared_prompts(
    input_ids: torch.Tensor, prompt_lens: torch.Tensor, seq_lens: torch.Tensor, multiple: int = 1
) -> SharedPromptPack:
    """The rows of ``input_ids`` (``[b, L]`` right padded, ``prompt + response``) packed with
    each distinct prompt once, the pack's length a multiple of ``multiple``."""
    device = input_ids.device
    plens = [int(x) for x in prompt_lens.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    rows = input_ids.tolist()
    if len(plens) != len(rows) or len(lens) != len(rows):
        raise ValueError(
            f"{len(plens)} prompt and {len(lens)} sequence lengths for {len(rows)} rows"
        )
    for p, n in zip(plens, lens, strict=True):
        if not 1 <= p <= n <= input_ids.shape[1]:
            raise ValueError(
                f"each row needs 1 <= prompt length <= sequence length <= {input_ids.shape[1]}; "
                f"got prompt {p}, sequence {n}"
            )
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, (p, row) in enumerate(zip(plens, rows, strict=True)):
        groups.setdefault(tuple(row[:p]), []).append(r)
    b = len(rows)
    prompt_offsets, response_offsets = [0] * b, [0] * b
    tokens: list[int] = []
    positions: list[int] = []
    segment_lens: list[int] = []
    masks: list[torch.Tensor | None] = []
    for prompt, members in groups.items():
        start, p = len(tokens), len(prompt)
        tokens.extend(prompt)
        positions.extend(range(p))
        responses = []
        for r in members:
            prompt_offsets[r], response_offsets[r] = start, len(tokens)
            response = rows[r][p : lens[r]]
            tokens.extend(response)
            positions.extend(range(p, p + len(response)))
            responses.append(len(response))
        segment_lens.append(len(tokens) - start)
        shared = sum(1 for n in responses if n) > 1
        masks.append(_segment_mask(p, responses, device) if shared else None)
    tail = -len(tokens) % multiple
    if tail:
        tokens.extend([0] * tail)
        positions.extend(range(tail))
        segment_lens.append(tail)
        masks.append(None)
    cu = torch.zeros(len(segment_lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.tensor(segment_lens, dtype=torch.int32, device=device).cumsum(0)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return SharedPromptPack(
        input_ids=as_tensor(tokens).unsqueeze(0),
        position_ids=as_tensor(positions).unsqueeze(0),
        cu_seqlens=cu,
        max_seqlen=max(segment_lens),
        masks=tuple(masks),
        prompt_offsets=as_tensor(prompt_offsets),
        prompt_lens=as_tensor(plens),
        response_offsets=as_tensor(response_offsets),
        response_lens=as_tensor([n - p for n, p in zip(lens, plens, strict=True)]),
    )


def _groups(pack: SharedPromptPack) -> list[list[int]]:
    """The pack's rows by group (rows sharing one prompt), each in row order."""
    groups: dict[int, list[int]] = {}
    for row, offset in enumerate(pack.prompt_offsets.tolist()):
        groups.setdefault(int(offset), []).append(row)
    return list(groups.values())


def shared_values(pack: SharedPromptPack, values: torch.Tensor, fill: int) -> torch.Tensor:
    """Per-token values of the padded rows (``[b, L, ...]``) laid out as the pack's tokens
    (``[T, ...]``): a response token's from its row, a shared prompt token's from the first row
    of its group (the pack runs the prompt once), ``fill`` at the pad tail."""
    out = values.new_full((pack.num_tokens, *values.shape[2:]), fill)
    for members in _groups(pack):
        first = members[0]
        start, p = int(pack.prompt_offsets[first]), int(pack.prompt_lens[first])
        out[start : start + p] = values[first, :p]
        for row in members:
            at, n = int(pack.response_offsets[row]), int(pack.response_lens[row])
            out[at : at + n] = values[row, p : p + n]
    return out


def shared_sources(pack: SharedPromptPack, width: int) -> torch.Tensor:
    """``[T, m]``: for each token of the pack, the flat positions (``row * width + column``) in
    the padded ``[b, width]`` rows it stands for: a shared prompt token its place in every row
    of its group (``m`` the largest group), a response token its own; ``-1`` fills."""
    groups = _groups(pack)
    host = torch.device("cpu")  # the routing flags' positions live in host memory
    out = torch.full((pack.num_tokens, max(map(len, groups))), -1, dtype=torch.long, device=host)
    for members in groups:
        first = members[0]
        start, p = int(pack.prompt_offsets[first]), int(pack.prompt_lens[first])
        for j, row in enumerate(members):
            out[start : start + p, j] = torch.arange(p, device=host) + row * width
            at, n = int(pack.response_offsets[row]), int(pack.response_lens[row])
            out[at : at + n, 0] = torch.arange(p, p + n, device=host) + row * width
    return out


def _rotary_hook(module, args, output):
    positions = _POSITIONS.get()
    if positions is None:
        return output
    if int(positions.max()) >= output.shape[0]:
        raise RuntimeError(
            f"the rotary table covers {output.shape[0]} positions, the pack needs "
            f"{int(positions.max()) + 1}"
        )
    return output[positions.to(output.device)]


def check_supported(model: torch.nn.Module) -> None:
    """Raise unless ``model`` can run a shared-prompt pack (rope, megarl's SDPA attention)."""
    if id(model) in _CHECKED:
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megarl.models.attention import SDPACoreAttention

    modules = list(model.modules())
    if not any(isinstance(m, SDPACoreAttention) for m in modules):
        raise ValueError(
            "actor.share_prompts needs megarl's SDPA core attention (the local layer spec, as on "
            "CPU); Transformer Engine's fused attention cannot take the per-group masks: set "
            "actor.share_prompts=false"
        )
    for m in modules:
        if hasattr(m, "rotary_pos_emb") and type(m.rotary_pos_emb) is not RotaryEmbedding:
            raise ValueError(
                "actor.share_prompts needs plain rope position embeddings (this model's are "
                f"{type(m.rotary_pos_emb).__name__}): set actor.share_prompts=false"
            )
    _CHECKED.add(id(model))


def _install_rotary_hooks(model: torch.nn.Module) -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for m in model.modules():
        if type(m) is RotaryEmbedding and id(m) not in _HOOKED:
            m.register_forward_hook(_rotary_hook)
            _HOOKED.add(id(m))


@contextlib.contextmanager
def rotary_positions(model: torch.nn.Module, pack: SharedPromptPack) -> Iterator[None]:
    """Inside the block the model's rotary frequencies are per token of ``pack`` (at its
    positions), which megatron's THD rope applies one to one."""
    check_supported(model)
    _install_rotary_hooks(model)
    token = _POSITIONS.set(pack.position_ids[0])
    try:
        yield
    finally:
        _POSITIONS.reset(token)
