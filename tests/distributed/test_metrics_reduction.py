"""reduce_metrics over 3 gloo ranks: each metric is reduced as declared, whatever its name says."""

from __future__ import annotations

import pytest

from megarl.metrics import Metric, Reduce, maximum, mean, minimum, reduce_metrics, total
from tests.mp import run_gloo


def _reduce_worker(rank: int, world_size: int) -> dict[str, float]:
    v = float(rank + 1)  # 1, 2, 3
    metrics = {
        "a/mean": mean(v),
        "a/sum": total(v),
        "a/min": minimum(v),
        "a/max": maximum(v),
        "b/value_max": mean(v),  # named like a maximum, declared a mean
        "b/peak": maximum(v),  # a maximum without the name
        "b/nan_on_rank0": mean(float("nan") if rank == 0 else v),
    }
    if rank == 2:
        metrics["c/last_stage_only"] = mean(10.0)
    return reduce_metrics(metrics)


def _conflict_worker(rank: int, world_size: int) -> str:
    how = Reduce.MAX if rank == 0 else Reduce.MIN
    try:
        reduce_metrics({"x": Metric(1.0, how)})
    except ValueError as e:
        return str(e)
    return ""


def test_reduction_follows_the_declaration():
    results = run_gloo(_reduce_worker, 3, timeout=120)
    assert results[0] == results[1] == results[2]
    out = results[0]
    assert out["a/mean"] == pytest.approx(2.0)
    assert out["a/sum"] == pytest.approx(6.0)
    assert out["a/min"] == 1.0 and out["a/max"] == 3.0
    assert out["b/value_max"] == pytest.approx(2.0)
    assert out["b/peak"] == 3.0
    assert out["b/nan_on_rank0"] == pytest.approx(2.5)  # NaN counts as absent
    assert out["c/last_stage_only"] == 10.0  # absent keys are not zeros


def test_ranks_declaring_different_reductions_fail():
    messages = run_gloo(_conflict_worker, 2, timeout=120)
    assert all("declare one reduction" in m for m in messages)


# ---- the step's rollout statistics at TP2 x DP2 == at one process ------------------------------

# each DP rank's share: (data source, score, scorer status, finish reason, response length) per
# sample; unequal sizes, sources spread unevenly (only DP0 holds "b", only DP1 holds "c")
_SHARES = [
    [
        ("a", 1.0, "ok", "stop", 3),
        ("a", 0.25, "ok", "length", 8),
        ("b", 0.0, "error", "stop", 2),
        ("a", 0.5, "ok", "stop", 5),
    ],
    [
        ("a", 0.75, "ok", "stop", 4),
        ("c", 2.0, "ok", "length", 8),
        ("c", 0.0, "timeout", "length", 8),
        ("c", 1.5, "ok", "stop", 1),
        ("c", -0.5, "ok", "stop", 6),
        ("a", 0.0, "error", "stop", 7),
    ],
]
_ROLLOUT_KEYS = (
    "reward/mean",
    "reward/std",
    "reward/samples",
    "reward/failures",
    "reward/timeouts",
    "reward/a/mean",
    "reward/a/count",
    "reward/b/mean",
    "reward/b/count",
    "reward/c/mean",
    "reward/c/count",
    "response/length_mean",
    "response/clip_ratio",
    # the other reward sources' counts, means and std (megarl.rewards.shares)
    "reward/rollout_samples",
    "reward/rule_mean",
    "reward/model_mean",
    "reward/model_std",
    "reward/overlong_penalty_mean",
    "reward/remote_samples",
    "reward/remote_mean",
    "reward/remote_failures",
    "reward/remote_timeouts",
    "reward/remote_retries",
    "reward/remote/odd",
    "reward/remote_samples/odd",
    "reward/judge_samples",
    "reward/judge_mean",
    "reward/judge_failures",
    "reward/judge_unparsed",
    "reward/judge_timeouts",
)


def _replica() -> int:
    """This rank's place in its model-parallel group (0 in one process): what the remote service
    and the judge answer depends on it, so a replica that asked for itself would report other
    scores and counts than the group's first rank, which alone asks."""
    from megarl import parallel

    return parallel.tp_rank() if parallel.model_parallel_is_initialized() else 0


def _text(row: tuple[str, float, str, str, int]) -> str:
    return f"{row[0]} {row[1]} {row[2]} {row[4]}"


def _service():
    """A remote reward service (one request per sample) answering from the response: length 8
    fails after 2 retries, 7 times out, the others score ``score + length`` after ``length % 2``
    retries; an odd length also returns the extra metric "odd" (the length): at DP2 two of
    DP0's samples return it and one of DP1's."""
    import json

    from megarl.rewards.remote import Answer, RemoteScorer
    from megarl.rewards.remote_protocol import RemoteScore
    from megarl.rewards.remote_settings import RemoteSettings

    class Service(RemoteScorer):
        async def _post_all(self, bodies):
            answers = []
            for body, _ in bodies:
                _, score, _, length = json.loads(body)["samples"][0]["response"].split()
                n, replica = int(length), _replica()
                if n == 8:
                    answers.append(Answer(None, "error", "HTTP 500", retries=2))
                elif n == 7:
                    answers.append(Answer(None, "timeout", "no answer"))
                else:
                    extra = {"odd": float(n + replica)} if n % 2 else {}
                    scored = [RemoteScore(float(score) + n + 10 * replica, extra)]
                    answers.append(Answer(scored, "ok", retries=n % 2 + 100 * replica))
            return answers

    return Service(RemoteSettings("http://service", batch_size=1))


class _Judge:
    """A judge's answers from the response: none for a scorer timeout (a timeout) or length 1
    (an error), no score for source "b", else ``length / 4``."""

    name = "the test judge"

    def answer(self, prompts):
        from megarl.rewards.judge import NoAnswer

        answers: list = []
        for prompt in prompts:
            source, _, status, length = prompt.split()
            if status == "timeout":
                answers.append(NoAnswer("timeout", "slow"))
            elif length == "1":
                answers.append(NoAnswer("error", "refused"))
            elif source == "b":
                answers.append("no idea")
            else:
                answers.append(f"Score: {int(length) / 4 + _replica()}")
        return answers


def _step_batch(rows: list[tuple[str, float, str, str, int]]):
    """A StepBatch of ``rows`` with the reward sources' metrics of them, as score_rollout reports
    them: the reward manager's, a rule mean, a reward model's mean and std, the overlong penalty's
    mean, and a remote service's and a judge's, asked as score_rollout asks them (batch_scores:
    once per model-parallel group)."""
    import re

    import torch

    from megarl.data import PromptItem
    from megarl.envs.trajectory import Trajectory
    from megarl.rewards.judge import JudgeScorer
    from megarl.rewards.judge_prompt import JudgeTemplate
    from megarl.rewards.manager import RewardManager, RewardSample
    from megarl.rewards.overlong import overlong_penalty
    from megarl.rewards.scoring import ScoreOutcome
    from megarl.rollout.rollout_batch import RolloutBatch
    from megarl.trainer.batch import Samples, StepBatch
    from megarl.trainer.experience import batch_scores

    samples = Samples.from_sequences(
        [[1, 2]] * len(rows), [[3] * r[4] for r in rows], list(range(len(rows))), 0, "cpu"
    )
    scores = torch.tensor([r[1] for r in rows])
    outcomes = [ScoreOutcome(i, r[2], r[1]) for i, r in enumerate(rows)]  # type: ignore[arg-type]
    reward = RewardManager._metrics([RewardSample(r[0], "", None) for r in rows], outcomes)
    model = scores * 2 - samples.response_lens / 10
    penalty = overlong_penalty(
        samples.response_lens, max_length=8, buffer_length=4, penalty_factor=1.0
    )
    reward |= {
        "reward/rollout_samples": float(len(rows)),
        "reward/rule_mean": float(scores.mean()),
        "reward/model_mean": float(model.mean()),
        "reward/model_std": float(model.std()),
        "reward/overlong_penalty_mean": float(penalty.mean()),
    }
    items = [PromptItem(i, [1, 2], "", r[0], None) for i, r in enumerate(rows)]
    batch = RolloutBatch([Trajectory(i, [1, 2]) for i in range(len(rows))], list(range(len(rows))))
    texts, everything = [_text(r) for r in rows], range(len(rows))
    judge = JudgeScorer(JudgeTemplate("{response}", re.compile(r"Score: (\S+)")), _Judge())
    for scorer in (_service(), judge):
        reward |= batch_scores(scorer, items, batch, texts, torch.device("cpu"), everything)[1]
    return StepBatch(samples, scores, [r[3] for r in rows], reward)


def _rollout_worker(rank: int, world_size: int) -> dict[str, float]:
    from megarl import parallel
    from megarl.platform import adapt_megatron_for_cpu
    from megarl.trainer.step_metrics import rollout_metrics

    adapt_megatron_for_cpu()
    parallel.initialize_model_parallel(parallel.ParallelLayout.for_world(world_size, tp=2))
    try:
        batch = _step_batch(_SHARES[parallel.dp_rank()])
        return reduce_metrics(rollout_metrics(batch, {}))
    finally:
        parallel.destroy_model_parallel()


def test_rollout_statistics_at_tp2_dp2_are_those_of_one_process():
    """reward/mean, std, the reward sources' counts, means and stds (the manager's per source,
    a reward model's, a remote service's and a judge's), length mean and clip ratio of unequal DP
    shares (TP replicas holding the same samples) are those of one process with all the samples:
    not each rank's statistic averaged, nor a count summed once per replica. The service and the
    judge answer a TP replica other than the group's first differently: it must not ask them."""
    from megarl.trainer.step_metrics import rollout_metrics

    results = run_gloo(_rollout_worker, 4, timeout=180)
    assert all(r == results[0] for r in results)
    one = rollout_metrics(_step_batch(_SHARES[0] + _SHARES[1]), {})  # no process group
    assert one["reward/samples"].value == 10.0 and one["reward/c/count"].value == 4.0
    # counts that DP2 would halve, if averaged over ranks
    assert one["reward/remote_failures"].value == 4 and one["reward/remote_timeouts"].value == 1
    assert one["reward/remote_retries"].value == 3 * 2 + 3  # failed; odd lengths 3, 5, 1
    assert one["reward/remote/odd"].value == 3.0  # (3 + 5 + 1) / 3; DP ranks' means: 4 and 1
    assert one["reward/judge_failures"].value == 3.0 and one["reward/judge_unparsed"].value == 1
    for key in _ROLLOUT_KEYS:
        assert results[0][key] == pytest.approx(one[key].value, abs=1e-6), key


# ---- rows moved between DP ranks: each rank receives its own values only ------------------------


def _exchange_worker(rank: int, world_size: int) -> list[tuple[int, int, int]]:
    from megarl import parallel
    from megarl.platform import adapt_megatron_for_cpu
    from megarl.trainer.dp_collectives import dp_exchange

    adapt_megatron_for_cpu()
    parallel.initialize_model_parallel(parallel.ParallelLayout.for_world(world_size, tp=2))
    try:
        me, tp = parallel.dp_rank(), parallel.tp_rank()
        # to DP rank d: (sender's DP rank, d, sender's TP rank)
        return dp_exchange([(me, d, tp) for d in range(parallel.dp_size())])
    finally:
        parallel.destroy_model_parallel()


def test_dp_exchange_delivers_each_value_to_its_dp_rank_within_the_replica():
    """dp_exchange at TP2 x DP2 (DP groups are not the world: their ranks map to global ranks):
    each rank receives, in DP rank order, exactly what each DP rank of its own DP group sent to
    it, and nothing meant for another rank or from another TP replica."""
    results = run_gloo(_exchange_worker, 4, timeout=180)
    for rank, received in enumerate(results):
        tp, dp = rank % 2, rank // 2  # megatron's order: TP innermost
        assert [tuple(v) for v in received] == [(s, dp, tp) for s in range(2)], rank
