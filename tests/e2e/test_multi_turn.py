"""Multi-turn GRPO runs through `megarl train` at TP2 x PP2 (4 ranks), with an environment
defined in `relay_env.py` through the public API (``rollout.env=relay_env.py:Relay``).

Three launches: the real CPU vLLM at TP2 (2 steps, validation at 2), the Hugging Face rollout
backend (3 steps, checkpoint at 2) and its resume from step 2. Checked: each sample's environment
runs once (not once per tensor-parallel rank); the rollout-trainer logprob mismatch over model
tokens is <= 1e-4 (fp32) at every step, in the metrics and token by token; in the dumped rollouts
(trainer.dump_rollouts) the response mask is 0 exactly at the environment's tokens, which are the
chat template's delta of its messages, token for token, and carry no advantage, no rollout
logprob and no reward; the resumed steps equal the uninterrupted ones; validation shows whole
conversations.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from megarl.envs import ChatDeltas
from megarl.tools.data_prep.arithmetic import prepare as prepare_arithmetic
from tests.assets import tiny_char_llama_dir
from tests.e2e.relay_env import FOLLOW_UP
from tests.e2e.test_train import by_step, train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("multi_turn")
    prepare_arithmetic(work / "data", "add3", train_size=64, test_size=4)
    config = {
        "model": {"path": str(tiny_char_llama_dir())},
        "parallel": {"tp": 2, "pp": 2, "infer_tp": 2},
        "data": {
            "train_files": [str(work / "data" / "train.parquet")],
            "val_files": [str(work / "data" / "test.parquet")],
            "train_batch_size": 4,
            "val_batch_size": 4,
            "max_prompt_length": 1024,
        },
        "rollout": {
            # 12-token turns around a 38-token environment turn
            "sampling": {"n": 4, "max_response_length": 72},
            "engine": {"kv_cache_gib": 0.125},
            "env": f"{Path(__file__).resolve().parent / 'relay_env.py'}:Relay",
            "environment": {"max_turns": 3, "max_turn_tokens": 12},
        },
        "actor": {"ppo_mini_batch_size": 4, "micro_batch_size": 8, "optim": {"lr": 1e-3}},
        "reward": {"custom_fn": "megarl.rewards.toy:vowel_rate"},
        "trainer": {
            "total_steps": 3,
            "save_freq": 2,
            "dump_rollouts": True,
            "loggers": ["console"],
            "mlflow_tracking_uri": "none",
        },
    }
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    return work


@pytest.fixture(scope="module")
def vllm_run(workdir) -> dict[int, dict]:
    return by_step(
        train(
            workdir,
            "vllm",
            f"rollout.env_kwargs.log_file={workdir / 'resets.txt'}",
            "trainer.total_steps=2",
            "trainer.save_freq=0",
            "trainer.test_freq=2",
            nproc=4,
        )
    )


@pytest.fixture(scope="module")
def hf_run(workdir) -> dict[int, dict]:
    return by_step(train(workdir, "hf", "rollout.engine.backend=hf", nproc=4))


def _check_mismatch_and_turns(run: dict[int, dict], steps: int) -> None:
    for step in range(1, steps + 1):
        m = run[step]
        assert m["rollout/logprob_diff_max"] <= 1e-4, (step, m["rollout/logprob_diff_max"])
        assert m["rollout/turns_mean"] == 2 and m["rollout/turns_max"] == 2, step
        assert m["rollout/env/follow_ups_mean"] == 1 and m["rollout/env_failures"] == 0
        assert m["rollout/env_tokens_mean"] > 0 and m["reward/env_outcome_share"] == 1


def _check_dumped_masks(out: Path, steps: int) -> None:
    """The mask against the token ids: 0 exactly on the spans the environment added, each the
    template's delta for its follow-up message; no advantage, rollout logprob or reward there."""
    tok = AutoTokenizer.from_pretrained(tiny_char_llama_dir())
    deltas = ChatDeltas(tok)
    for step in range(1, steps + 1):
        [dump] = (out / "rollouts").glob(f"step_{step:06d}_dp0.jsonl")
        records = _records(dump)
        assert len(records) == 16
        for r in records:
            ids, mask = r["response_ids"], r["response_mask"]
            assert len(mask) == len(ids) == len(r["advantages"]) == len(r["rollout_log_prob"])
            spans = _spans(mask)  # (start, end, is_model)
            env_spans = [(a, b) for a, b, model in spans if not model]
            assert [model for *_, model in spans] == [True, False, True]  # turn, env, turn
            [(a, b)] = env_spans
            stop = tok.decode(ids[a - 1 : a]) if ids[a - 1] == tok.eos_token_id else None
            expected = deltas.env_ids([{"role": "user", "content": FOLLOW_UP.format(k=1)}], stop)
            assert ids[a:b] == expected, (tok.decode(ids[a:b]), tok.decode(expected))
            for key in ("advantages", "rollout_log_prob", "token_level_rewards"):
                assert all(v == 0.0 for v in r[key][a:b]), key
            assert any(v != 0.0 for v in r["rollout_log_prob"][:a])
            # the trainer scored the same ids: its logprobs equal the rollout engine's
            model = [k for k, m in enumerate(mask) if m]
            assert all(r["old_log_prob"][k] < 0 for k in model)
            assert max(abs(r["old_log_prob"][k] - r["rollout_log_prob"][k]) for k in model) <= 1e-4
            # each model turn's reward sits on its last token
            rewards = r["token_level_rewards"]
            assert {i for i, v in enumerate(rewards) if v != 0} <= {a - 1, len(ids) - 1}


def _spans(mask: list[int]) -> list[tuple[int, int, bool]]:
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, bool(mask[start])))
            start = i
    return out


def test_vllm_multi_turn_mismatch_masks_and_validation(workdir, vllm_run):
    _check_mismatch_and_turns(vllm_run, 2)
    _check_dumped_masks(workdir / "vllm", 2)
    # each sample's environment ran once (on one rank of its TP2 engine), with its own seed:
    # 2 steps x 16 samples + 4 validation samples
    seeds = (workdir / "resets.txt").read_text().split()
    assert len(seeds) == 36 and len(set(seeds)) == 36
    val = vllm_run[2]
    assert val["val/turns_mean"] == 2 and val["val/arithmetic/prompts"] == 4
    console = (workdir / "vllm" / "console.log").read_text()
    assert "conversation=[user]" in console and "[assistant]" in console
    # the run folder keeps the table; its prompt is the environment's opening (the dataset's
    # prompt cut to 30 characters and a digit in brackets), what the model saw
    rows = json.loads((workdir / "vllm" / "validation" / "step_000002.json").read_text())
    assert len(rows) == 4
    for row in rows:
        assert re.fullmatch(r"\[user\] .{1,30} \(\d\)", row["prompt"], re.DOTALL), row["prompt"]
        assert row["conversation"].startswith(row["prompt"] + "\n[assistant] ")


def test_hf_backend_multi_turn_and_its_resume(workdir, hf_run):
    _check_mismatch_and_turns(hf_run, 3)
    _check_dumped_masks(workdir / "hf", 3)
    ckpts = workdir / "resumed" / "checkpoints"
    shutil.copytree(workdir / "hf" / "checkpoints" / "step_00000002", ckpts / "step_00000002")
    (ckpts / "latest").write_text("step_00000002\n")
    resumed = by_step(train(workdir, "resumed", "rollout.engine.backend=hf", nproc=4))
    assert min(resumed) == 3
    for key in (
        "reward/mean",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/grad_norm",
        "rollout/env_tokens_mean",
        "response/length_mean",
    ):
        assert resumed[3][key] == pytest.approx(hf_run[3][key], abs=1e-6), key
    # the same trajectories, token for token, and the same advantages
    full, again = (
        _records(workdir / run / "rollouts" / "step_000003_dp0.jsonl") for run in ("hf", "resumed")
    )
    for a, b in zip(full, again, strict=True):
        assert (a["prompt_ids"], a["response_ids"], a["response_mask"]) == (
            b["prompt_ids"],
            b["response_ids"],
            b["response_mask"],
        )
        assert a["advantages"] == pytest.approx(b["advantages"], abs=1e-6)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
