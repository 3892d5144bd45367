"""SFT, DPO and a distillation teacher at TP2 x PP2 (sequence parallel, packed micro-batches) on 4
gloo ranks, in one launch, against references megarl did not write: transformers (SFT loss,
accuracy, gradients), torch AdamW (one optimizer step), TRL's DPOTrainer (tokenized ids, five
loss types' losses, rewards, reward accuracy, margins, logprobs, and the sigmoid loss's
gradients) and transformers again (a bigger teacher's logprobs at the policy's layout).

Tolerances (fp32): SFT loss 1e-5 relative, gradients 1e-6 and weights after the step 1e-6
absolute (the largest gradient is ~1e-1); DPO losses 1e-5 absolute, metrics 1e-5 relative to
max(1, |value|), gradients 1e-5 of the largest; teacher logprobs 1e-5.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import tests.distributed.post_training_workers as w
from tests.assets import tiny_chat_llama_dir
from tests.mp import run_gloo

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

PAIRS = [
    {
        "prompt": [{"role": "user", "content": f"What is {i} plus {i + 3}?"}],
        "chosen": f"It is {2 * i + 3}.",
        "rejected": "I do not know, sorry! " * (i % 3 + 1),
    }
    for i in range(5)
]
SFT_ROWS = [
    {"prompt": [{"role": "user", "content": "Name a colour."}], "response": "Blue."},
    {"prompt": "Count to three.", "response": "One, two, three."},
    {
        "messages": [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello, how can I help?"},
            {"role": "user", "content": "Say yes."},
            {"role": "assistant", "content": "Yes."},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": "6, of course."},
        ]
    },
    {"prompt": [{"role": "user", "content": "Spell cat."}], "response": "C-A-T"},
]


def _perturbed_copy(src: Path, out: Path, seed: int, scale: float) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def _bigger_teacher(src: Path, out: Path) -> Path:
    """A random causal LM with the policy's tokenizer and twice its depth and width."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from megarl.tools.testing.assets import randomize_

    config = AutoConfig.from_pretrained(src)
    config.num_hidden_layers *= 2
    config.hidden_size *= 2
    config.intermediate_size *= 2
    config.num_attention_heads *= 2
    config.num_key_value_heads *= 2
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, 3)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def _trainer_runs(work: Path) -> dict:
    """The SFT and DPO trainer runs that resume at another layout: configs/chain_{sft,dpo}_cpu.yaml
    with the toy task's rows on short prompts (DPO validates on held-out pairs), the tiny
    character model, 4 steps of 8 rows or pairs at TP2 x PP2."""
    from megarl.tools.data_prep.toy_vowels import preference_rows, sft_rows
    from tests.assets import tiny_char_llama_dir

    runs = work / "runs"
    runs.mkdir()
    # 32 training rows or pairs: the 4 steps of 8 stay in one epoch (a later epoch is dealt over
    # the data-parallel ranks of the new layout, so it holds other batches than the old one's)
    prompts = [[{"role": "user", "content": f"Say {i} in vowels."}] for i in range(40)]
    pq.write_table(pa.Table.from_pylist(sft_rows(prompts[:32])), runs / "sft.parquet")
    pairs = preference_rows(prompts)
    pq.write_table(pa.Table.from_pylist(pairs[:32]), runs / "prefs.parquet")
    pq.write_table(pa.Table.from_pylist(pairs[32:]), runs / "prefs_test.parquet")
    common = [
        f"model.path={tiny_char_llama_dir()}",
        "parallel.tp=2",
        "parallel.pp=2",
        "data.train_batch_size=8",
        "data.val_batch_size=8",
        "trainer.total_steps=4",
        "trainer.save_freq=2",
        "trainer.test_freq=4",
        "trainer.loggers=[console]",
        "trainer.mlflow_tracking_uri=none",
    ]
    sft = [
        *common,
        f"data.train_files=[{runs / 'sft.parquet'}]",
        "data.val_files=[]",
        "sft.micro_batch_size=2",
        "sft.max_length=128",
    ]
    dpo = [
        *common,
        f"data.train_files=[{runs / 'prefs.parquet'}]",
        f"data.val_files=[{runs / 'prefs_test.parquet'}]",
        "dpo.micro_batch_size=1",
        "dpo.max_length=128",
        "dpo.optim.lr=1e-3",
    ]
    configs = ROOT / "configs"
    return {
        "work": str(runs),
        "trainers": {
            "sft": (
                "train-sft",
                str(configs / "chain_sft_cpu.yaml"),
                sft,
                ["parallel.tp=1", "parallel.pp=1"],
            ),
            "dpo": ("train-dpo", str(configs / "chain_dpo_cpu.yaml"), dpo, ["parallel.tp=1"]),
        },
    }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("post_training")
    runs = _trainer_runs(work)
    policy = tiny_chat_llama_dir()
    reference = _perturbed_copy(policy, work / "reference", seed=7, scale=0.02)
    teacher = _bigger_teacher(policy, work / "teacher")
    (work / "pairs.json").write_text(json.dumps(PAIRS))
    pq.write_table(pa.Table.from_pylist(PAIRS), work / "pairs.parquet")
    # the two formats, and prompts as messages or a string, in files of their own
    for name, rows in (("a", [0, 4]), ("b", [2, 3]), ("c", [1])):
        table = pa.Table.from_pylist([SFT_ROWS[i] for i in rows])
        pq.write_table(table, work / f"sft_{name}.parquet")
    trl_out = work / "trl.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "trl_dpo_reference.py"),
            str(policy),
            str(reference),
            str(work / "pairs.json"),
            str(trl_out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {
        "policy": str(policy),
        "reference": str(reference),
        "teacher": str(teacher),
        "sft": str(work / "sft_*.parquet"),
        "pairs": str(work / "pairs.parquet"),
        "trl": str(trl_out),
        "runs": runs,
    }


def test_sft_dpo_and_teacher_equal_their_references_at_tp2_pp2(inputs):
    results = run_gloo(
        w.post_training_worker,
        4,
        inputs["policy"],
        inputs["reference"],
        inputs["teacher"],
        inputs["sft"],
        inputs["pairs"],
        inputs["trl"],
        inputs["runs"],
    )
    print(json.dumps(results, indent=1, sort_keys=True))  # shown when an assertion fails
    last_stage = [r for r in results if "sft:loss_rel" in r]
    assert len(last_stage) == 2  # the two TP ranks of the last stage
    for r in results:
        assert r["sft:micro_batches"] == 3 and r["sft:packed"] == 1.0  # 5 rows, 2 per micro-batch
        assert r["sft:masked_tokens"] > 0  # the user turns between assistant turns
        assert r["sft:grad_ref_max"] > 1e-2, r  # a real gradient
        assert r["sft:grad"] <= 1e-6, r
        assert r["sft:step_ok"] == 1.0 and r["sft:weight"] <= 1e-6, r
        assert r["dpo:same_ids_as_trl"] == 1.0
        assert r["dpo:grad_ref_max"] > 1e-2, r
        assert r["dpo:grad"] <= 1e-5 * r["dpo:grad_ref_max"], r
        assert r["teacher:layers"] == 4 and r["teacher:logprob"] <= 1e-5, r
        assert r["lora:step_ok"] == 1.0
    for r in last_stage:
        assert r["sft:loss_rel"] <= 1e-5 and r["sft:accuracy_diff"] <= 1e-6, r
        for loss in w.DPO_LOSSES:
            assert r[f"dpo:{loss}:loss"] <= 1e-5, (loss, r)
            for key in w.TRL_METRICS.values():
                assert r[f"dpo:{loss}:{key}"] <= 1e-5, (loss, key, r)
        # LoRA: the reference is the actor's base, untouched by a step on the adapters
        assert r["lora:base_vs_plain"] <= 1e-5 and r["lora:policy_vs_plain"] > 1e-3, r
        # the reference differs from the policy: the pairs have real margins (DPO's loss is not
        # log 2)
        assert abs(r["dpo:sigmoid:loss_value"] - math.log(2)) > 0.05, r
    # the trainers resumed at another layout continue as the uninterrupted run: step 3 from the
    # same restored weights (float rounding of another reduction order), step 4 after one more
    # Adam step on gradients reduced in another order
    for r in results:
        for name in ("sft", "dpo"):
            assert r[f"{name}:resumed_from"] == 3.0
            for key, diff in r.items():
                if key.startswith(f"{name}:step3:"):
                    assert diff <= 1e-5, (key, diff)
                if key.startswith(f"{name}:step4:"):
                    assert diff <= 1e-3, (key, diff)
        # DPO learns: its reward accuracy on the 8 held-out pairs, 0 before any step (every pair
        # a tie: the policy is its reference), rises
        assert r["dpo:val_pairs"] == 8 and r["dpo:val_accuracy_before"] == 0.0
        assert r["dpo:val_accuracy_after"] >= 0.75, r
