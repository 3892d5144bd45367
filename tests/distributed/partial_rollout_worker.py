"""A weight update landing in the middle of a generation (``rollout.placement.partial``), in the real CPU
vLLM engine: ``python tests/distributed/partial_rollout_worker.py MODEL_DIR``.

The batch is generated in rounds of 6 tokens; after the first round the engine loads other
weights (version 1). Printed as JSON: per sample the tokens, the engine's logprobs and each
token's recorded version, the same batch generated at version 0 only, and the teacher-forced
logprobs of every token under each version's weights by transformers (the reference the test
checks the engine against).

Then, in the same engine (version 1), the step loop (``megarl.rollout.step_loop``): a long
request runs, two shorter ones join it while it runs; printed: each request's tokens, logprobs,
the step it joined and the step it finished, the same requests in one ``generate`` call, and
transformers' teacher-forced logprobs.
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
    steps = step_loop_run(engine, sampling, lambda p, r: teacher_forced(v1, p, r))
    print(
        "RESULT="
        + json.dumps(
            {"samples": samples, "rounds": partial.rounds, "calls": rounds, "step_loop": steps}
        )
    )


def step_loop_run(engine, sampling, reference) -> list[dict]:
    """Requests of 30, 4 and 10 tokens; the last two are submitted as the first's third step
    starts, so they join at its fourth."""
    import threading
    from dataclasses import replace

    from megarl.rollout.engine_calls import EngineCall, Request
    from megarl.rollout.step_loop import StepLoop

    requests = [
        Request([5, 40, 41, 42, 7], 30, 11),
        Request([5, 60, 61, 7], 4, 12),
        Request([5, 70, 71, 72, 73, 7], 10, 13),
    ]
    sampling = replace(sampling, n=1)
    in_one_call = EngineCall(tuple(requests)).make(engine, sampling)
    added: list[list[str]] = []  # the keys added before each step
    futures = []

    def announce(step) -> None:  # runs in the loop's thread before each step
        added.append([key for key, _ in step.added])
        if len(added) == 3:
            futures.extend(loop.submit(r) for r in requests[1:])

    loop = StepLoop(engine, sampling, announce, window_s=0)
    thread = threading.Thread(target=loop.run)
    thread.start()
    futures.insert(0, loop.submit(requests[0]))
    while len(futures) < 3:
        threading.Event().wait(0.001)
    finished: dict[int, int] = {}
    for k, future in enumerate(futures):
        future.add_done_callback(lambda _, k=k: finished.setdefault(k, loop.steps))
    results = [f.result(timeout=300) for f in futures]
    loop.close()
    thread.join()
    joined = [n for n, keys in enumerate(added) for _ in keys]  # in the order submitted
    return [
        {
            "tokens": r.ids,
            "logprobs": r.logprobs,
            "finish": r.finish,
            "joined_at_step": joined[k],  # 0-based: the step it was added before
            "finished_after_steps": finished[k],
            "one_call_tokens": c.ids,
            "ref": reference(q.prompt_ids, r.ids),
        }
        for k, (q, r, c) in enumerate(zip(requests, results, in_one_call, strict=True))
    ]


if __name__ == "__main__":
    main(sys.argv[1])
