"""A weight update landing in the middle of a generation (``rollout.partial``), in the real CPU
vLLM engine: ``python tests/distributed/partial_rollout_worker.py MODEL_DIR``.

The batch is generated in rounds of 6 tokens; after the first round the engine loads other
weights (version 1). Printed as JSON: per sample the tokens, the engine's logprobs and each
token's recorded version, the same batch generated at version 0 only, and the teacher-forced
logprobs of every token under each version's weights by transformers (the reference the test
checks the engine against).
"""

from __future__ import annotations

import json
import os
import sys

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TEMPERATURE = 0.8
CHUNK = 6


def main(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from megarl.rollout.rollout_types import EngineConfig, SamplingConfig
    from megarl.rollout.versioned import generate_versioned
    from megarl.rollout.vllm_rollout import VLLMRollout
    from megarl.tools.testing.assets import randomize_

    torch.set_num_threads(2)
    v0 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    v1 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    randomize_(v1, seed=99)
    engine = VLLMRollout(
        model_dir, 1, EngineConfig(max_model_len=128, kv_cache_bytes=64 << 20, max_num_seqs=16)
    )
    prompts = [[5, 40, 41, 42, 7], [5, 60, 61, 7], [5, 70, 71, 72, 73, 7]]
    sampling = SamplingConfig(
        temperature=TEMPERATURE, max_new_tokens=20, n=2, seed=3, ignore_eos=True, stop_token_ids=()
    )
    rounds = []

    def between(active: bool) -> int:
        rounds.append(active)
        if len(rounds) == 1:  # the update lands after the first round
            engine.update_weights([(n, p.detach().clone()) for n, p in v1.named_parameters()])
            engine.after_weight_update()
        return 1

    # version 0 alone first (the same seeds): the partial batch's first round must equal it
    only_v0 = generate_versioned(engine, prompts, sampling, rollout=11, first_prompt=0, version=0)
    engine.update_weights([(n, p.detach().clone()) for n, p in v0.named_parameters()])
    engine.after_weight_update()
    partial = generate_versioned(engine, prompts, sampling, 11, 0, 0, chunk=CHUNK, between=between)

    def teacher_forced(model, prompt: list[int], response: list[int]) -> list[float]:
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
        lp = torch.log_softmax(logits, dim=-1)
        return lp.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()

    out = partial.output
    samples = []
    for k in range(len(out.token_ids)):
        prompt, tokens = prompts[out.prompt_index[k]], out.token_ids[k]
        samples.append(
            {
                "tokens": tokens,
                "logprobs": out.logprobs[k],
                "versions": partial.versions[k],
                "finish": out.finish_reasons[k],
                "only_v0_tokens": only_v0.output.token_ids[k],
                "ref_v0": teacher_forced(v0, prompt, tokens),
                "ref_v1": teacher_forced(v1, prompt, tokens),
            }
        )
    print("RESULT=" + json.dumps({"samples": samples, "rounds": partial.rounds, "calls": rounds}))


if __name__ == "__main__":
    main(sys.argv[1])
