"""GRPO on a black-box agent through `megarl train` at TP2 x PP2 (4 ranks):
``rollout.agent=openai_agent.py:three_turns``, written with the ``openai`` client alone.

Six launches: the HF backend for 3 steps (two rollout engines of TP2, a checkpoint at step 2)
and its resume from step 2, the real CPU vLLM at TP2 for 2 steps, the HF backend in
asynchronous mode (``rollout.placement.mode=async``: the trainers at TP2 x PP2 beside a rollout group of 2
ranks, one engine of TP2) at ``rollout.placement.max_staleness=0`` for 3 steps and its resume from step 2,
and vLLM TP2 in asynchronous mode for 2 steps. Checked: each sample's
agent runs once (on one rank of its engine); three model turns per sample; the rollout-trainer
logprob mismatch over model tokens is <= 1e-4 (fp32) at every step, in the metrics and token by
token; in the dumped rollouts the response mask is 0 exactly at the tokens the agent's tool
messages added (there are some), which carry no advantage, no rollout logprob and no reward; the
agent's reward is the sample's; each resumed step 3 equals its uninterrupted run's (the same
agent conversations, token for token); the asynchronous run equals the colocated one at every step
(the same conversations token for token, rewards, losses and grad norms within 1e-6 of their
scale): a sample's seeds depend on its global index and the rollout count alone, and the HF
engine's calls are batch invariant.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from megarl.tools.data_prep.arithmetic import prepare as prepare_arithmetic
from tests.assets import tiny_char_llama_dir
from tests.e2e.test_multi_turn import _spans as mask_spans
from tests.e2e.test_train import by_step, train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS, PROMPTS, N = 3, 2, 2
VAL_ROWS = 2  # the vLLM run's validation samples (rollout.sampling.val_n is 1)
QUIET = {"loggers": ["console"], "mlflow_tracking_uri": "none"}
ASYNC_PLACEMENT = (
    "rollout.placement.mode=async",
    "parallel.rollout_ranks=2",
    "rollout.placement.max_staleness=0",
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("agent")
    data = work / "data"
    prepare_arithmetic(data, "add3", train_size=16, test_size=2)
    train_files = [str(data / "train.parquet")]
    config = {
        "model": {"path": str(tiny_char_llama_dir())},
        "parallel": {"tp": 2, "pp": 2, "infer_tp": 2},  # two rollout engines of TP2
        "data": {"train_files": train_files, "train_batch_size": PROMPTS, "max_prompt_length": 256},
        "rollout": {
            "engine": {"backend": "hf"},
            "sampling": {"n": N, "max_response_length": 128},
            "environment": {"max_turn_tokens": 12},
            "agent": f"{Path(__file__).resolve().parent / 'openai_agent.py'}:three_turns",
        },
        "actor": {"ppo_mini_batch_size": PROMPTS, "micro_batch_size": 4, "optim": {"lr": 1e-3}},
        "reward": {"custom_fn": "megarl.rewards.toy:vowel_rate"},
        # a checkpoint at step 2 for the resume; every step's rollouts dumped
        "trainer": {"total_steps": STEPS, "save_freq": 2, "dump_rollouts": True, **QUIET},
    }
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    return work


@pytest.fixture(scope="module")
def hf_run(workdir) -> dict[int, dict]:
    log = {"AGENT_LOG": str(workdir / "agent_runs.txt")}
    return by_step(train(workdir, "hf", nproc=4, env_extra=log))


@pytest.fixture(scope="module")
def vllm_run(workdir) -> dict[int, dict]:
    log = {"AGENT_LOG": str(workdir / "vllm_agent_runs.txt")}
    overrides = (
        "rollout.engine.backend=vllm",
        "rollout.engine.kv_cache_gib=0.125",
        "trainer.save_freq=0",
    )
    # a validation pass at step 2 over the test set's 2 rows, through the agent too
    val = (f"data.val_files=[{workdir / 'data' / 'test.parquet'}]", "trainer.test_freq=2")
    return by_step(
        train(workdir, "vllm", *overrides, *val, "trainer.total_steps=2", nproc=4, env_extra=log)
    )


@pytest.fixture(scope="module")
def async_run(workdir) -> dict[int, dict]:
    log = {"AGENT_LOG": str(workdir / "async_agent_runs.txt")}
    # a checkpoint at step 2 (trainer.save_freq) for the asynchronous resume
    return by_step(train(workdir, "async", *ASYNC_PLACEMENT, nproc=6, env_extra=log))


@pytest.fixture(scope="module")
def vllm_async_run(workdir) -> dict[int, dict]:
    log = {"AGENT_LOG": str(workdir / "vllm_async_agent_runs.txt")}
    overrides = (
        "rollout.engine.backend=vllm",
        "rollout.engine.kv_cache_gib=0.125",
        "trainer.save_freq=0",
    )
    return by_step(
        train(
            workdir,
            "vllm_async",
            *ASYNC_PLACEMENT,
            *overrides,
            "trainer.total_steps=2",
            nproc=6,
            env_extra=log,
        )
    )


def _check_agent_run(
    run: dict[int, dict], out: Path, agent_log: Path, steps: int, validated: int = 0
) -> None:
    samples = PROMPTS * N
    for step in range(1, steps + 1):
        m = run[step]
        assert m["rollout/logprob_diff_max"] <= 1e-4, (step, m["rollout/logprob_diff_max"])
        assert m["rollout/turns_mean"] == 3 and m["rollout/turns_max"] == 3, step
        assert m["rollout/env_tokens_mean"] > 0 and m["rollout/env_failures"] == 0
        assert m["agent/samples"] == samples and m["agent/requests_mean"] == 3
        assert m["agent/failures"] == m["agent/timeouts"] == m["agent/non_continuations"] == 0
        assert m["reward/env_outcome_share"] == 1  # the agent's reward, not the scorer's
    # each sample's agent ran once: on one rank of its TP2 engine, not on each
    assert len(agent_log.read_text().splitlines()) == steps * samples + validated
    for step in range(1, steps + 1):
        [dump] = (out / "rollouts").glob(f"step_{step:06d}_dp0.jsonl")
        records = _rollouts(dump)
        assert len(records) == samples
        for r in records:
            ids, mask = r["response_ids"], r["response_mask"]
            assert len(mask) == len(ids) == len(r["advantages"]) == len(r["rollout_log_prob"])
            # model turn, the agent's tool message, model turn, tool message, model turn
            assert [model for *_, model in mask_spans(mask)] == [True, False, True, False, True]
            for a, b, model in mask_spans(mask):
                if not model:  # masked: no advantage, rollout logprob or reward
                    for key in ("advantages", "rollout_log_prob", "token_level_rewards"):
                        assert all(v == 0.0 for v in r[key][a:b]), key
            # the trainer scored the same ids: its logprobs equal the rollout engine's (fp32)
            model_at = [k for k, m in enumerate(mask) if m]
            assert all(r["old_log_prob"][k] < 0 for k in model_at)
            diff = max(abs(r["old_log_prob"][k] - r["rollout_log_prob"][k]) for k in model_at)
            assert diff <= 1e-4, diff
            # the agent's reward sits on the last model token alone
            rewards = r["token_level_rewards"]
            assert {i for i, v in enumerate(rewards) if v != 0} <= {model_at[-1]}


def test_an_openai_client_agent_trains_at_tp2_pp2_on_hf(workdir, hf_run):
    _check_agent_run(hf_run, workdir / "hf", workdir / "agent_runs.txt", STEPS)


def test_an_openai_client_agent_trains_at_tp2_pp2_on_vllm_tp2(workdir, vllm_run):
    _check_agent_run(vllm_run, workdir / "vllm", workdir / "vllm_agent_runs.txt", 2, VAL_ROWS)
    assert vllm_run[2]["val/turns_mean"] == 3


def test_an_agent_trains_in_asynchronous_mode_on_vllm_tp2(workdir, vllm_async_run):
    """The rollout group's one vLLM engine of TP2: its first rank runs the agents and the
    endpoint, its second makes the same engine calls (announced over the engine's group)."""
    out, log = workdir / "vllm_async", workdir / "vllm_async_agent_runs.txt"
    _check_agent_run(vllm_async_run, out, log, 2)
    assert all(vllm_async_run[s]["rollout/staleness_max"] == 0.0 for s in (1, 2))


def test_an_agent_trains_in_asynchronous_mode_as_colocated(workdir, async_run, hf_run):
    _check_agent_run(async_run, workdir / "async", workdir / "async_agent_runs.txt", STEPS)
    for step in range(1, STEPS + 1):
        a, b = async_run[step], hf_run[step]
        assert a["rollout/staleness_max"] == 0.0
        compared = [k for k in b if k.startswith(("reward/", "actor/", "rollout/env", "agent/"))]
        compared = [k for k in compared if not k.endswith(("_s", "/s"))]  # not wall times
        assert {"actor/pg_loss", "actor/grad_norm", "reward/mean"} <= set(compared)
        for key in compared:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-6), (step, key)
        _same_samples(workdir, "async", "hf", step)


def _rollouts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same_samples(workdir: Path, one: str, other: str, step: int) -> None:
    """Two runs' dumped samples of ``step``: the same conversations, token for token, and the
    same advantages."""
    name = f"step_{step:06d}_dp0.jsonl"
    ours = _rollouts(workdir / one / "rollouts" / name)
    theirs = _rollouts(workdir / other / "rollouts" / name)
    assert len(ours) == len(theirs) == PROMPTS * N
    for a, b in zip(ours, theirs, strict=True):
        for key in ("prompt_ids", "response_ids", "response_mask"):
            assert a[key] == b[key], (step, key)
        assert a["advantages"] == pytest.approx(b["advantages"], abs=1e-6)


def _resume_from_step_2(workdir: Path, run: str, name: str, *overrides: str, nproc: int) -> dict:
    """``run``'s step-2 checkpoint resumed by a new launch ``name`` to step 3: its steps."""
    saved = workdir / run / "checkpoints" / "step_00000002"
    ckpts = workdir / name / "checkpoints"
    shutil.copytree(saved, ckpts / saved.name)
    (ckpts / "latest").write_text(f"{saved.name}\n")
    resumed = by_step(train(workdir, name, *overrides, nproc=nproc))
    assert min(resumed) == STEPS
    return resumed


def _same_step(resumed: dict[int, dict], uninterrupted: dict[int, dict]) -> None:
    compared = [
        k for k in uninterrupted[STEPS] if k.startswith(("reward/", "actor/", "rollout/env"))
    ]
    assert "actor/pg_loss" in compared and "reward/mean" in compared
    for key in compared:
        assert resumed[STEPS][key] == pytest.approx(uninterrupted[STEPS][key], abs=1e-6), key


def test_a_resumed_agent_run_equals_the_uninterrupted_one(workdir, hf_run):
    resumed = _resume_from_step_2(workdir, "hf", "resumed", nproc=4)
    _same_step(resumed, hf_run)
    _same_samples(workdir, "resumed", "hf", STEPS)


def test_a_resumed_asynchronous_agent_run_equals_the_uninterrupted_one(workdir, async_run):
    """The asynchronous run's step-2 checkpoint (trainers and the rollout group's state)
    resumed in asynchronous mode: step 3 is the uninterrupted run's, conversations included."""
    resumed = _resume_from_step_2(workdir, "async", "async_resumed", *ASYNC_PLACEMENT, nproc=6)
    assert resumed[STEPS]["rollout/turns_mean"] == 3 and resumed[STEPS]["agent/failures"] == 0
    _same_step(resumed, async_run)
    _same_samples(workdir, "async_resumed", "async", STEPS)
