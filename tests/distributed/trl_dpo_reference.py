"""TRL's DPOTrainer as the reference of megarl's DPO (run in a subprocess of its own, so that TRL
and accelerate stay out of the test process and its gloo workers):

    python tests/distributed/trl_dpo_reference.py POLICY_DIR REFERENCE_DIR PAIRS.json OUT.pt

PAIRS.json: conversational pairs (prompt messages, chosen and rejected replies). TRL tokenizes the
pairs itself and collates them into one batch; for each loss type it computes its loss and
metrics on the whole batch, for ``sigmoid`` also the policy's gradients. OUT.pt holds, per loss
type, TRL's tokenized ids, loss, rewards/chosen, rewards/rejected, rewards/accuracies,
rewards/margins, logps/chosen, logps/rejected, and the gradients by HF parameter name; "beta" the
beta they all use and "label_smoothing" the robust loss's.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

LOSSES = ("sigmoid", "ipo", "hinge", "robust", "sigmoid_norm")
BETA = 0.3
LABEL_SMOOTHING = 0.2


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
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    # The pad token is also the end-of-turn token, trained in every response: without
    # padding_idx its embedding row gets its input gradient, as in megatron and the math.
    policy.get_input_embeddings().padding_idx = None
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(
            output_dir=tmp,
            loss_type=["sigmoid"],
            beta=BETA,
            label_smoothing=LABEL_SMOOTHING,  # read by the robust loss only
            max_length=None,
            report_to=[],
            use_cpu=True,
            bf16=False,
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
        ids = [
            {k: list(e[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for e in examples
        ]
        policy.train()
        for loss_type in LOSSES:
            # the loss of each type on the same trainer, as DPOConfig(loss_type=[...]) sets it
            trainer.loss_types, trainer.loss_weights = [loss_type], [1.0]
            policy.zero_grad()
            loss = trainer.compute_loss(policy, batch)
            record = {
                "loss": float(loss.detach()),
                "metrics": {k: v[-1] for k, v in trainer._metrics["train"].items()},
                "ids": ids,
            }
            if loss_type == "sigmoid":
                loss.backward()
                record["grads"] = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}
            out[loss_type] = record
    torch.save({"beta": BETA, "label_smoothing": LABEL_SMOOTHING, **out}, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:5])
