"""``trainer.dump_rollouts``: what each step trained on, sample by sample, as JSON lines.

``OUTPUT/rollouts/step_<step>_dp<rank>.jsonl`` (one file per data-parallel rank, written by its
first tensor- and pipeline-parallel rank): per sample its prompt and response token ids, the
response mask (0 at a multi-turn trajectory's environment tokens), the rollout engine's and the
actor's logprobs, the advantages, the token rewards, and the decoded text. For inspecting a run
(e.g. what an environment appended, what the model was rewarded for), not for resuming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from megarl import parallel
from megarl.files import temporary_beside
from megarl.trainer.batch import Samples
from megarl.trainer.token_tensors import TokenField

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# the per-token tensors a record holds (where the step filled them), under their field names
DUMPED: tuple[TokenField, ...] = (
    "rollout_log_prob",
    "old_log_prob",
    "advantages",
    "token_level_rewards",
)


def sample_records(samples: Samples, tokenizer: PreTrainedTokenizerBase) -> list[dict[str, object]]:
    seq = samples.seq_lens().tolist()
    prompt = samples.prompt_lens.tolist()
    resp = samples.response_lens.tolist()
    ids = samples.input_ids.cpu().tolist()
    mask = samples.response_mask.cpu().tolist()
    present = samples.tensors.present()
    tensors = {k: present[k].float().cpu().tolist() for k in DUMPED if k in present}
    out = []
    for i in range(samples.size):
        row = ids[i][: seq[i]]
        record: dict[str, object] = {
            "group": str(samples.group_ids[i]),
            "prompt_ids": row[: prompt[i]],
            "response_ids": row[prompt[i] :],
            "response_mask": [int(m) for m in mask[i][: resp[i]]],
            "prompt": tokenizer.decode(row[: prompt[i]]),
            "response": tokenizer.decode(row[prompt[i] :]),
        }
        for key, values in tensors.items():
            record[key] = values[i][: resp[i]]
        out.append(record)
    return out


def dump_rollout(
    output_dir: str, step: int, samples: Samples, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Write this DP rank's samples of ``step`` (1-based); atomically, one rank per DP rank."""
    if parallel.tp_rank() != 0 or parallel.pp_rank() != 0:
        return
    folder = Path(output_dir) / "rollouts"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}_dp{parallel.dp_rank()}.jsonl"
    with temporary_beside(path) as (f, partial):
        for record in sample_records(samples, tokenizer):
            f.write((json.dumps(record) + "\n").encode())
    os.replace(partial, path)
