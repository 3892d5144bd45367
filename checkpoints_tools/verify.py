"""Check a Hugging Face folder against a megarl checkpoint: tensor by tensor, and by logits.

Tensors: every tensor the checkpoint implies is read from both sides one at a time (the
checkpoint's converted to the HF folder's dtype, as the export does) and compared bit for bit.
Logits: the megatron model built from the checkpoint (at ``layout``) and transformers' model
loaded from the HF folder run the same fixed batch; their max abs difference is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoints_tools.mcore_to_hf import plan_groups
from megarl import parallel, platform
from megarl.checkpoint.hf_assets import read_json
from megarl.checkpoint.reader import DistCheckpointReader
from megarl.checkpoint.store import (
    MCORE_SUBDIR,
    build_model_from_checkpoint,
    checkpoint_dims,
    read_meta,
    resolve_checkpoint,
)
from megarl.errors import CheckpointError
from megarl.models.build import ModelOptions
from megarl.models.forward import gather_vocab, run_schedule
from megarl.models.heads import has_scalar_head, hf_folder_role
from megarl.models.safetensors_io import SafetensorsReader
from megarl.parallel import destroy_model_parallel, initialize_model_parallel

# Buffers some older HF checkpoints store; they are recomputed, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class TensorCheck:
    name: str
    status: str  # equal | differs | shape | missing | unexpected
    max_abs: float = 0.0
    detail: str = ""


@dataclass
class VerifyReport:
    hf_dir: Path
    ckpt: Path
    role: str
    ckpt_dtype: str
    saved_layout: dict
    tensors: list[TensorCheck] = field(default_factory=list)
    hf_dtype: str = ""
    logits: dict | None = None
    rtol: float = 1e-4

    @property
    def tensors_ok(self) -> bool:
        return all(t.status == "equal" for t in self.tensors)

    @property
    def logits_ok(self) -> bool:
        if self.logits is None:
            return True
        return self.logits["max_abs"] <= self.rtol * max(self.logits["ref_max"], 1.0)

    @property
    def ok(self) -> bool:
        return self.tensors_ok and self.logits_ok

    def lines(self) -> list[str]:
        lay = self.saved_layout
        out = [
            f"verify: {self.hf_dir} vs checkpoint {self.ckpt} ({self.role}, {self.ckpt_dtype}, "
            f"saved at TP{lay.get('tp')}xPP{lay.get('pp')})"
        ]
        equal = sum(t.status == "equal" for t in self.tensors)
        out.append(
            f"  tensors: {equal}/{len(self.tensors)} bit-identical (HF folder in {self.hf_dtype})"
        )
        for t in [t for t in self.tensors if t.status != "equal"][:20]:
            extra = f" max|diff| {t.max_abs:.3e}" if t.status == "differs" else ""
            out.append(f"    {t.status:10s} {t.name}{extra} {t.detail}".rstrip())
        if self.logits is not None:
            lg = self.logits
            rel = lg["max_abs"] / max(lg["ref_max"], 1e-30)
            out.append(
                f"  {lg['what']} at {lg['layout']} on a {lg['batch']}x{lg['seq']} batch: "
                f"max |megatron - transformers| = {lg['max_abs']:.3e} (max |value| "
                f"{lg['ref_max']:.3g}, relative {rel:.2e}, limit {self.rtol:.0e} relative)"
            )
            out.append(f"  greedy-token agreement {lg['agree']:.3f}" if "agree" in lg else "")
        out = [line for line in out if line]
        out.append("VERIFY OK" if self.ok else "VERIFY FAILED")
        return out


def _hf_dtype(reader: SafetensorsReader) -> torch.dtype:
    return reader.read(reader.names()[0]).dtype if reader.names() else torch.float32


def compare_tensors(hf_dir: str | Path, ckpt: str | Path) -> tuple[list[TensorCheck], str]:
    """Tensor-by-tensor comparison (one process, one tensor pair in memory at a time)."""
    ckpt = resolve_checkpoint(ckpt)
    meta = read_meta(ckpt)
    dims = checkpoint_dims(ckpt)
    hf = SafetensorsReader(hf_dir)
    checks: list[TensorCheck] = []
    seen: set[str] = set()
    hf_dtype = None
    with DistCheckpointReader(ckpt / MCORE_SUBDIR) as reader:
        for g in plan_groups(dims, meta.role, reader):
            for name, t in g.convert(g.read(reader), dims):
                seen.add(name)
                if not hf.has(name):
                    checks.append(TensorCheck(name, "missing", detail="(not in the HF folder)"))
                    continue
                h = hf.read(name)
                hf_dtype = hf_dtype or h.dtype
                if tuple(h.shape) != tuple(t.shape):
                    checks.append(
                        TensorCheck(
                            name, "shape", detail=f"HF {tuple(h.shape)} vs {tuple(t.shape)}"
                        )
                    )
                    continue
                mine = t.to(h.dtype)
                if torch.equal(h, mine):
                    checks.append(TensorCheck(name, "equal"))
                else:
                    diff = (h.double() - mine.double()).abs().max().item()
                    checks.append(TensorCheck(name, "differs", max_abs=diff))
    for name in hf.names():
        if name in seen or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and dims.tie_word_embeddings and not has_scalar_head(meta.role):
            # A tied model saved with its LM head spelled out: it must equal the embedding.
            same = torch.equal(hf.read(name), hf.read("model.embed_tokens.weight"))
            checks.append(TensorCheck(name, "equal" if same else "differs", detail="(tied)"))
            continue
        checks.append(TensorCheck(name, "unexpected", detail="(not in the checkpoint)"))
    return checks, str(hf_dtype or _hf_dtype(hf)).removeprefix("torch.")


def _hf_model(hf_dir: Path):
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    classes = {
        "critic": AutoModelForTokenClassification,
        "reward": AutoModelForSequenceClassification,
    }
    cls = classes.get(hf_folder_role(read_json(hf_dir / "config.json")), AutoModelForCausalLM)
    return cls.from_pretrained(hf_dir, dtype=torch.float32).eval()


@torch.no_grad()
def compare_outputs(
    hf_dir: str | Path, ckpt: str | Path, layout, *, batch: int = 2, seq: int = 16, seed: int = 0
) -> dict | None:
    """Logits (actor) or values (critic) of both models on a fixed batch; collective.

    Returns the comparison on rank 0 (None elsewhere). Where the HF folder holds a lower
    precision than float32, the megatron weights are rounded to it first, so both sides run the
    same weights in float32.
    """

    hf_dir = Path(hf_dir)
    hf_dtype = _hf_dtype(SafetensorsReader(hf_dir))
    initialize_model_parallel(layout)
    try:
        model, dims, meta = build_model_from_checkpoint(
            ckpt, layout, opts=ModelOptions(dtype=torch.float32)
        )
        if hf_dtype != torch.float32:
            for p in model.parameters():
                p.copy_(p.to(hf_dtype).float())
        model.eval()
        gen = torch.Generator().manual_seed(seed)
        # Drawn on the CPU generator (the same batch on every machine), then on the model's device.
        ids = torch.randint(0, dims.vocab_size, (batch, seq), generator=gen, device="cpu")
        pad = read_json(hf_dir / "config.json").get("pad_token_id")
        if pad is not None:  # a sequence classifier stops at the first pad token
            ids[ids == pad] = (pad + 1) % dims.vocab_size
        critic = has_scalar_head(meta.role)

        def pick(out):
            if meta.role == "reward":  # one score per row, at its last token
                return out[:, -1, :]
            return out if critic else gather_vocab(out)

        outs = run_schedule(
            [model],
            [{"input_ids": ids.to(platform.device())}],
            lambda out, b: (out.sum() * 0.0, {"out": pick(out)}),
            forward_only=True,
        )
        result = None
        if outs and parallel.tp_rank() == 0:
            mine = outs[0]["out"].float().cpu()
            ref = _hf_model(hf_dir)(ids).logits.float()
            result = {
                "what": {"critic": "values", "reward": "scores"}.get(meta.role, "logits"),
                "layout": str(layout),
                "batch": batch,
                "seq": seq,
                "max_abs": (mine - ref).abs().max().item()
                if mine.shape == ref.shape
                else float("inf"),
                "ref_max": ref.abs().max().item(),
            }
            if not critic and mine.shape == ref.shape:
                result["agree"] = (mine.argmax(-1) == ref.argmax(-1)).float().mean().item()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
    finally:
        destroy_model_parallel()
    found = [r for r in gathered if r is not None]
    return found[0] if found and dist.get_rank() == 0 else None


def start_report(hf_dir: str | Path, ckpt: str | Path, rtol: float) -> VerifyReport:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"Hugging Face folder {hf_dir} does not exist")
    SafetensorsReader(hf_dir)  # clear errors for missing or partial weights
    ckpt = resolve_checkpoint(ckpt)
    meta = read_meta(ckpt)
    return VerifyReport(hf_dir, ckpt, meta.role, meta.dtype, meta.saved_layout, rtol=rtol)
