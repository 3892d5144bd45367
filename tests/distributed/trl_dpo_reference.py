"""TRL's DPOTrainer as the reference of megarl's DPO (run in a subprocess of its own, so that TRL
and accelerate stay out of the test process and its gloo workers):

    python tests/distributed/trl_dpo_reference.py POLICY_DIR REFERENCE_DIR PAIRS.json OUT.pt

PAIRS.json: conversational pairs (prompt messages, chosen and rejected replies). For each loss
type TRL tokenizes the pairs itself, collates them into one batch and computes its loss and
metrics on the whole batch; for ``sigmoid`` also the policy's gradients. OUT.pt holds, per loss
type, TRL's tokenized ids, loss, rewards/chosen, rewards/rejected, rewards/accuracies,
rewards/margins, logps/chosen, logps/rejected, and the gradients by HF parameter name; "beta" the
beta they all use.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

LOSSES = {
    "sigmoid": {},
    "ipo": {},
    "hinge": {},
    "robust": {"label_smoothing": 0.2},
    "sigmoid_norm": {},
}
BETA = 0.3


def main(policy_dir: str, reference_dir: str, pairs_file: str, out_file: str) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    pairs = json.loads(Path(pairs_file).read_text())
    rows = [
        {
            "prompt": p["prompt"],
            "chosen": [{"role": "assistant", "content": p["chosen"]}],
            "rejected": [{"role": "assistant", "content": p["rejected"]}],
        }
        for p in pairs
    ]
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for loss_type, extra in LOSSES.items():
            policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
            reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
            args = DPOConfig(
                output_dir=tmp,
                loss_type=[loss_type],
                beta=BETA,
                max_length=None,
                report_to=[],
                use_cpu=True,
                bf16=False,
                dataset_num_proc=None,
                **extra,
            )
            trainer = DPOTrainer(
                model=policy,
                ref_model=reference,
                args=args,
                train_dataset=Dataset.from_list(rows),
                processing_class=tokenizer,
            )
            data = trainer.train_dataset
            examples = [data[i] for i in range(len(data))]
            batch = trainer.data_collator(examples)
            policy.train()
            loss = trainer.compute_loss(policy, batch)
            loss.backward()
            metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
            record = {
                "loss": float(loss),
                "metrics": metrics,
                "ids": [
                    {k: list(e[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
                    for e in examples
                ],
            }
            if loss_type == "sigmoid":
                record["grads"] = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}
            out[loss_type] = record
    torch.save({"beta": BETA, **out}, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:5])
