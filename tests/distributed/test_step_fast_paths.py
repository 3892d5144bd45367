"""megarl's faster training-step paths equal megatron-core's own code on the same model (fp32).

Three replacements, checked together on one rank against megatron's originals: the output layer
run on batch-major rows (no copies of the logits, megarl.models.forward), rope with its cosines
and sines kept and no closing copy (megarl.models.rotary), and in-place grad scaling for clipping
(megarl.models.grad_scale). The reference is a second model with the same weights, called as
megatron's GPTModel with megatron's rope and its copying ``local_multi_tensor_scale``.
Tolerances: logits and loss 1e-6 absolute, gradients 1e-7 absolute (sums over the batch's rows
in another order); the clipped gradients after scaling bitwise equal to megatron's scaling of the
same gradients. The RL paths (logits at chosen positions, padded and packed rows) against
megatron's full logits gathered at those positions: logits 1e-6, gradients 2e-6 relative to the
largest gradient (measured 6e-7: the packed attention runs per sequence, other float sums).
"""

from __future__ import annotations

import pytest
import torch

from megarl.tools.testing.assets import tiny_qwen2_dir
from tests.mp import run_gloo

pytestmark = pytest.mark.distributed


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    return -logp.gather(-1, ids[:, 1:, None]).mean()


def worker(rank: int, world: int, model_dir: str) -> dict[str, float]:
    from megatron.core import utils as megatron_utils
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import clip_grads

    from megarl.models import rotary
    from megarl.models.build import build_model
    from megarl.models.forward import position_ids_like, run_schedule, use_batch_major_output
    from megarl.models.grad_scale import scale_in_place, use_in_place_grad_scaling
    from megarl.parallel import ParallelLayout, initialize_model_parallel
    from megarl.platform import adapt_megatron_for_cpu

    adapt_megatron_for_cpu()
    initialize_model_parallel(ParallelLayout())
    ours, dims = build_model(model_dir, ParallelLayout())
    ref, _ = build_model(model_dir, ParallelLayout())
    ids = torch.randint(0, dims.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))

    # megarl's path: run_schedule installs the output-layer hooks; build_model the rope.
    assert rope_utils._apply_rotary_pos_emb_bshd is rotary.apply_rotary_bshd
    got: dict[str, torch.Tensor] = {}

    def loss_fn(logits, batch):
        got["logits"] = logits.detach().clone()
        loss = _loss(logits, ids)
        return loss, {"loss": loss.detach()}

    out = run_schedule(ours, [{"input_ids": ids}], loss_fn, forward_only=False)
    # megatron's own path: its rope, GPTModel's sequence-major output layer.
    with rotary.megatron_rotary():
        logits = ref(input_ids=ids, position_ids=position_ids_like(ids), attention_mask=None)
        ref_loss = _loss(logits, ids)
        ref_loss.backward()
    grads = [p.grad for p in ours.parameters()]
    ref_grads = [p.grad for p in ref.parameters()]

    out_rl = _rl_paths(ours, ref, dims.vocab_size)
    # The sequence-major layout kept for comparisons (bench/train_step.py --megatron-paths).
    use_batch_major_output(ours, False)
    with torch.no_grad():
        seq_major = run_schedule(
            ours,
            [{"input_ids": ids}],
            lambda out, batch: (out.sum() * 0.0, {"logits": out.clone()}),
            forward_only=True,
        )[0]["logits"]
    use_batch_major_output(ours, True)

    # Clipping's scale: in place vs megatron's fallback, on the same gradients.
    assert use_in_place_grad_scaling()
    assert clip_grads.multi_tensor_scale_impl is scale_in_place
    mine = [g.clone() for g in grads]
    theirs = [g.clone() for g in grads]
    scale_in_place(0, torch.zeros(1), [mine, mine], 0.37)
    megatron_utils.local_multi_tensor_scale(0, torch.zeros(1), [theirs, theirs], 0.37)
    return {
        "logits": (got["logits"] - logits.detach()).abs().max().item(),
        "seq_major_logits": (seq_major - logits.detach()).abs().max().item(),
        "loss": abs(float(out[0]["loss"]) - ref_loss.item()),
        "grads": max((a - b).abs().max().item() for a, b in zip(grads, ref_grads, strict=True)),
        "grad_scale": max(g.abs().max().item() for g in ref_grads),
        "grads_counted": float(sum(g is not None for g in grads)),
        "params": float(len(grads)),
        "scaled_equal": float(all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))),
        **out_rl,
    }


def _rl_paths(ours, ref, vocab: int) -> dict[str, float]:
    """Outputs at ``positions`` of right-padded rows, run padded and packed through run_schedule,
    against megatron's own full-logits call gathered at the same positions."""
    from megarl.models.forward import position_ids_like, run_schedule
    from megarl.models.rotary import megatron_rotary

    ids = torch.randint(1, vocab, (3, 12), generator=torch.Generator().manual_seed(1))
    lens = torch.tensor([12, 7, 4])
    for row, n in enumerate(lens.tolist()):
        ids[row, n:] = 0
    positions = torch.tensor([[5, 6, 7, 8], [2, 3, 4, 5], [0, 1, 2, 2]])
    for p in (*ours.parameters(), *ref.parameters()):
        p.grad = None
    with megatron_rotary():
        full = ref(input_ids=ids, position_ids=position_ids_like(ids), attention_mask=None)
        want = full.gather(1, positions[..., None].expand(-1, -1, full.shape[-1]))
        weights = torch.linspace(-1, 1, want.numel()).view_as(want)
        (want * weights).sum().backward()
    ref_grads = [p.grad for p in ref.parameters()]
    scale = max(g.abs().max().item() for g in ref_grads)
    out = {}
    for name, extra in (("padded", {}), ("packed", {"seq_lens": lens})):
        for p in ours.parameters():
            p.grad = None
        got = {}

        def loss_fn(logits, batch, got=got):
            got["logits"] = logits.detach().clone()
            return (logits * weights).sum(), {}

        batch = {"input_ids": ids, "positions": positions, **extra}
        run_schedule(ours, [batch], loss_fn, forward_only=False)
        out[f"{name}:logits"] = (got["logits"] - want.detach()).abs().max().item()
        out[f"{name}:grads"] = (
            max(
                (p.grad - g).abs().max().item()
                for p, g in zip(ours.parameters(), ref_grads, strict=True)
            )
            / scale
        )
    return out


def test_fast_paths_equal_megatron_own_code():
    r = run_gloo(worker, 1, str(tiny_qwen2_dir()))[0]
    print(r)  # the measured figures, for the log
    assert r["grads_counted"] == r["params"], r
    assert r["grad_scale"] > 1e-4, r  # what is compared is not all zero
    assert r["logits"] <= 1e-6 and r["loss"] <= 1e-6 and r["seq_major_logits"] <= 1e-6, r
    assert r["grads"] <= 1e-7, r
    assert r["scaled_equal"] == 1.0, r
    for name in ("padded", "packed"):
        assert r[f"{name}:logits"] <= 1e-6 and r[f"{name}:grads"] <= 2e-6, r
