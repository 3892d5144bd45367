"""TRL side of ``bench/grpo_step.py``: GRPO steps with TRL's ``GRPOTrainer`` on CPU, timed.

Runs in its own virtualenv (TRL + CPU torch, not megarl's), started by ``bench/grpo_step.py``:

    TRL_VENV/bin/python bench/_trl_grpo_worker.py SPEC.json

SPEC.json holds the model folder, the prompts (chat message lists, in step order), the reward's
source file and the settings. Prints one progress line per step and, last, one line
``BENCH_RESULT {json}`` with per-step timings and token counts, the update phase split by timers
(forward, TRL's chunked LM-head log-prob forward and backward, backward, grad clipping, optimizer
step), the tokens TRL actually runs through the model (padded) and the GRPOConfig settings in
force. With ``"profile_top": N`` in SPEC.json the update phase of one timed step (``profile_step``,
default the last) also runs under torch.profiler: its top N ops by self CPU time come back in the
result and the full table goes to ``profile_out`` when given.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time

from _trl_settings import comparable_grpo_settings, read_spec, run_facts


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


def add_seconds(rec: dict, key: str, seconds: float) -> None:
    rec[key] = rec.get(key, 0.0) + seconds


def time_chunked_logprob(current: dict) -> None:
    """Time TRL's chunked LM-head log-prob function (``trl.kernels.ChunkedLogProbFunction``, the
    projection onto the vocabulary + log-softmax of every scored position) and count the positions
    it scores, in the record ``current["rec"]``; forwards without grad (scoring passes) are kept
    apart. Also labels both directions for torch.profiler. Changes nothing it computes."""
    import torch
    from trl.kernels import chunked_logprob

    fn = chunked_logprob.ChunkedLogProbFunction
    forward, backward = fn.forward, fn.backward

    def timed_forward(ctx, hidden, *args, **kwargs):
        # Grad mode is off inside an autograd.Function's forward: a training call is told by
        # its input, the backbone's hidden states, which require grad only outside no_grad.
        training = hidden.requires_grad
        t0 = time.perf_counter()
        with torch.profiler.record_function("trl.chunked_logprob.forward"):
            out = forward(ctx, hidden, *args, **kwargs)
        rec = current["rec"]
        prefix = "lm_head" if training else "scoring_lm_head"
        add_seconds(rec, f"{prefix}_fwd_s", time.perf_counter() - t0)
        rec[f"{prefix}_positions"] = rec.get(f"{prefix}_positions", 0) + int(hidden.shape[0])
        return out

    def timed_backward(ctx, *grads):
        t0 = time.perf_counter()
        with torch.profiler.record_function("trl.chunked_logprob.backward"):
            out = backward(ctx, *grads)
        add_seconds(current["rec"], "lm_head_bwd_s", time.perf_counter() - t0)
        return out

    fn.forward = staticmethod(timed_forward)
    fn.backward = staticmethod(timed_backward)


SETTINGS_SHOWN = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "num_iterations",
    "num_generations",
    "beta",
    "loss_type",
    "gradient_checkpointing",
    "bf16",
    "torch_compile",
    "use_liger_kernel",
    "use_vllm",
    "vllm_importance_sampling_correction",
)


def settings_in_force(trainer) -> dict:
    """The GRPOConfig fields that decide the update's work, and what TRL derives from them."""
    from trl.kernels.chunked_logprob import _use_triton

    args = trainer.args
    out = {k: getattr(args, k, None) for k in SETTINGS_SHOWN}
    generate_every = args.steps_per_generation * args.num_iterations
    # TRL's own rule (GRPOTrainer._generate_and_score_completions) for a separate no-grad pass
    # computing old log-probs before the update.
    out["old_logprob_forward"] = bool(
        args.gradient_accumulation_steps % generate_every != 0
        or (args.use_vllm and args.vllm_importance_sampling_correction)
    )
    out["reference_model"] = trainer.ref_model is not None
    out["lm_head_scores"] = (
        "completion positions only (Triton)"
        if _use_triton(trainer.accelerator.device)
        else "every position, prompt and padding included (no Triton on this device)"
    )
    return out


def top_ops(prof, top: int) -> dict:
    """The profiled update's top ``top`` ops by self CPU time, and the labelled regions' totals."""
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    labels = {
        e.key: e.cpu_time_total / 1e6
        for e in events
        if e.key.startswith("trl.") or e.key.startswith("Optimizer.step")
    }
    return {
        "self_cpu_total_s": total,
        "top": [
            {"name": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in rows
        ],
        "regions_s": labels,
    }


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
    spec = read_spec(sys.argv[1])

    import torch
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
    current: dict = {"rec": records[0]}
    time_chunked_logprob(current)
    profile_top = int(spec.get("profile_top", 0))
    profile_step = int(spec.get("profile_step", steps - 1))
    profiled: dict = {}

    class Timed(GRPOTrainer):
        """Adds per-step phase timings and exact token counts; changes nothing it measures."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            backward = self.accelerator.backward

            def timed_backward(loss, **kwargs):
                t0 = time.perf_counter()
                with torch.profiler.record_function("trl.backward"):
                    backward(loss, **kwargs)
                add_seconds(current["rec"], "backward_s", time.perf_counter() - t0)

            self.accelerator.backward = timed_backward

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            rec = current["rec"]
            rows, prompt_width = inputs["prompt_ids"].shape
            width = prompt_width + inputs["completion_ids"].shape[1]
            rec["padded_tokens"] = rec.get("padded_tokens", 0) + rows * width
            rec["completion_tokens"] = rec.get("completion_tokens", 0) + int(
                inputs["completion_mask"].sum()
            )
            rec["micro_batches"] = rec.get("micro_batches", 0) + 1
            t0 = time.perf_counter()
            with torch.profiler.record_function("trl.forward_and_loss"):
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            add_seconds(rec, "forward_s", time.perf_counter() - t0)
            return loss

        def _clip_grad_norm(self, model):
            t0 = time.perf_counter()
            with torch.profiler.record_function("trl.clip_grad_norm"):
                out = super()._clip_grad_norm(model)
            add_seconds(current["rec"], "clip_s", time.perf_counter() - t0)
            return out

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
            if profile_top and self.state.global_step == profile_step:
                # The update phase only: from the end of the rollout to the end of the step.
                profiled["prof"] = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                )
                profiled["prof"].start()
            return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current["rec"] = records[state.global_step]
            self.t0 = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.t_opt = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            add_seconds(records[state.global_step], "optimizer_s", time.perf_counter() - self.t_opt)

        def on_step_end(self, args, state, control, **kwargs):
            i = state.global_step - 1
            rec = records[i]
            rec["step_s"] = time.perf_counter() - self.t0
            if "prof" in profiled and i == profile_step:
                prof = profiled.pop("prof")
                prof.stop()
                profiled["result"] = {"step": i, **top_ops(prof, profile_top)}
                if spec.get("profile_out"):
                    with open(spec["profile_out"], "w") as fh:
                        fh.write(
                            prof.key_averages().table(
                                sort_by="self_cpu_time_total", row_limit=max(profile_top, 40)
                            )
                        )
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
        **comparable_grpo_settings(spec, num_generations=n, max_steps=steps),
        per_device_train_batch_size=prompts_per_step * n,
        gradient_accumulation_steps=1,
        **vllm_settings(spec),
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
        **run_facts(),
        "steps": records,
        "settings": settings_in_force(trainer),
    }
    if "result" in profiled:
        result["profile"] = profiled["result"]
    print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
