"""TRL side of ``bench/grpo_step.py``: GRPO steps with TRL's ``GRPOTrainer`` on CPU, timed.

Runs in its own virtualenv (TRL + CPU torch, not megarl's), started by ``bench/grpo_step.py``:

    TRL_VENV/bin/python bench/_trl_grpo_worker.py SPEC.json

SPEC.json holds the model folder, the prompts (chat message lists, in step order), the reward's
source file and the settings. Prints one progress line per step and, last, one line
``BENCH_RESULT {json}`` with per-step timings and token counts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time


def load_reward(path: str, name: str):
    """The bench's reward function, loaded from its source file (megarl is not installed here)."""
    spec = importlib.util.spec_from_file_location("_bench_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    score = getattr(module, name)

    def reward(prompts, completions, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(score("bench", t)) for t in texts]

    reward.__name__ = name
    return reward


def vllm_settings(spec: dict) -> dict:
    """GRPOConfig settings of the rollout: HF ``generate``, or vLLM colocated in this process
    (fp32 like the trainer, no sleep mode: the CPU build has none)."""
    if not spec.get("use_vllm"):
        return {"use_vllm": False}
    return {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_enable_sleep_mode": False,
        "vllm_max_model_length": 1024,
        "vllm_tensor_parallel_size": 1,
    }


def main() -> None:
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    threads = int(spec["threads"])
    os.environ["OMP_NUM_THREADS"] = str(threads)

    import torch

    torch.set_num_threads(threads)

    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    steps = int(spec["warmup"]) + int(spec["steps"])
    n = int(spec["n"])
    prompts_per_step = int(spec["prompts_per_step"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    data = Dataset.from_dict({"prompt": spec["prompts"][: steps * prompts_per_step]})

    records: list[dict] = [{} for _ in range(steps)]

    class Timed(GRPOTrainer):
        """Adds per-step phase timings and exact token counts; changes nothing it measures."""

        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            prompt_ids, completion_ids = out[0], out[1]
            rec = records[self.state.global_step]
            rec["generate_s"] = time.perf_counter() - t0
            rec["generated_tokens"] = sum(len(c) for c in completion_ids)
            rec["prompt_tokens"] = sum(len(p) for p in prompt_ids)
            rec["sequences"] = len(completion_ids)
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            records[self.state.global_step]["rollout_s"] = time.perf_counter() - t0
            return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            i = state.global_step - 1
            rec = records[i]
            rec["step_s"] = time.perf_counter() - self.t0
            rec["update_s"] = rec["step_s"] - rec.get("rollout_s", 0.0)
            rec["trained_tokens"] = rec["prompt_tokens"] + rec["generated_tokens"]
            phase = "warm-up" if i < int(spec["warmup"]) else "timed"
            print(
                f"[trl] step {i + 1}/{steps} ({phase}): {rec['step_s']:.2f} s "
                f"(rollout {rec['rollout_s']:.2f} s), generated {rec['generated_tokens']}, "
                f"trained {rec['trained_tokens']}",
                flush=True,
            )

    args = GRPOConfig(
        output_dir=spec["output_dir"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        learning_rate=float(spec["lr"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=float(spec["weight_decay"]),
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        per_device_train_batch_size=prompts_per_step * n,
        gradient_accumulation_steps=1,
        num_generations=n,
        max_completion_length=int(spec["max_new_tokens"]),
        num_iterations=1,
        beta=0.0,
        loss_type="dapo",  # token-level mean over the batch, like megarl's token-mean
        scale_rewards="group",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        **vllm_settings(spec),
        max_steps=steps,
        shuffle_dataset=False,
        seed=int(spec["seed"]),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )
    trainer = Timed(
        model=model,
        reward_funcs=load_reward(spec["reward_file"], spec["reward_name"]),
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[StepClock()],
    )
    print(
        f"[trl] trl {trl.__version__}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        flush=True,
    )
    trainer.train()
    result = {
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "threads": torch.get_num_threads(),
        "steps": records,
    }
    print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
