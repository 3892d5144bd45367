"""RewardManager: routing by data_source, user scorers, failures and timeouts that never crash a run."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from megarl.errors import ConfigError
from megarl.rewards import RewardError, RewardManager, RewardSample
from megarl.rewards.shares import combine_shares

MODULE = "tests.unit.test_rewards_manager"


# ---- scorers the tests route to (module level, so worker processes can import them) ---------


def length_scorer(solution_str: str, ground_truth: Any, scale: float = 1.0) -> float:
    return scale * len(solution_str)


def failing_scorer(solution_str: str, ground_truth: Any) -> float:
    if "boom" in solution_str:
        raise RuntimeError("scorer exploded on purpose")
    return 1.0


def sleepy_scorer(solution_str: str, ground_truth: Any) -> float:
    time.sleep(float(solution_str))
    return 1.0


def stubborn_scorer(solution_str: str, ground_truth: Any) -> float:
    """Ignores the soft timeout, like code stuck in C: only killing the process stops it."""
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(float(solution_str))
    return 1.0


def crashing_scorer(solution_str: str, ground_truth: Any) -> float:
    if solution_str == "crash":
        os._exit(3)
    return 1.0


def odd_returns(solution_str: str, ground_truth: Any) -> Any:
    return {"nan": float("nan"), "text": "1.0", "dict": {"score": 0.5, "acc": True}, "bool": True}[
        solution_str
    ]


def verl_style(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float:
    return float(f"{data_source}|{solution_str}|{ground_truth}|{extra_info}" == "src|a|b|{'k': 1}")


def gsm(answer: str, truth: str = "72", source: str = "openai/gsm8k") -> RewardSample:
    return RewardSample(source, answer, truth)


# ---- routing --------------------------------------------------------------------------------


def test_routes_by_data_source_with_kwargs_and_reports_means() -> None:
    manager = RewardManager(
        {"len": f"{MODULE}:length_scorer"},
        scorer_kwargs={"len": {"scale": 0.5}, "openai/gsm8k": {"format_score": 0.1}},
    )
    result = manager.score(
        [gsm("#### 72"), gsm("#### 70"), RewardSample("len", "abcd", None), gsm("no answer")]
    )
    assert result.scores == [1.0, 0.1, 2.0, 0.0]
    assert result.failures == []
    assert result.metrics == {
        "reward/mean": pytest.approx(3.1 / 4),
        "reward/samples": 4.0,
        "reward/failures": 0.0,
        "reward/timeouts": 0.0,
        "reward/len/mean": 2.0,
        "reward/len/count": 1.0,
        "reward/openai/gsm8k/mean": pytest.approx(1.1 / 3),
        "reward/openai/gsm8k/count": 3.0,
    }


def test_shares_combine_to_the_metrics_of_the_whole_batch() -> None:
    """Scored in shares (one per DP rank) holding different sources and sizes, a share with no
    samples for the manager among them, the combined counts and per-source means are those of
    one score of every sample (each share's mean weighted by its count). A mean whose count no
    share holds is left out."""
    manager = RewardManager({"len": f"{MODULE}:length_scorer", "fail": f"{MODULE}:failing_scorer"})
    parts = [
        [gsm("#### 72"), RewardSample("len", "abcd", None), RewardSample("fail", "boom", None)],
        [gsm("#### 70"), gsm("no"), gsm("#### 72"), RewardSample("len", "ab", None)],
        [RewardSample("fail", "ok", None)],
    ]
    shares = [manager.score(p).metrics for p in parts]
    whole = manager.score([s for p in parts for s in p]).metrics
    combined = combine_shares([*shares, {"reward/rule_mean": 1.0}])
    assert combined == {k: pytest.approx(v) for k, v in whole.items() if k != "reward/mean"}
    assert combined["reward/samples"] == 8.0 and combined["reward/failures"] == 1.0


def test_user_scorer_from_a_file_path(tmp_path: Path) -> None:
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def exact(solution_str, ground_truth):\n    return float(solution_str == ground_truth)\n"
    )
    manager = RewardManager({"mine": f"{path}:exact"})
    assert manager.score(
        [RewardSample("mine", "x", "x"), RewardSample("mine", "x", "y")]
    ).scores == [1.0, 0.0]


def test_custom_fn_gets_verl_arguments_and_overrides_routing() -> None:
    manager = RewardManager(custom_fn=f"{MODULE}:verl_style")
    result = manager.score(
        [RewardSample("src", "a", "b", {"k": 1}), RewardSample("openai/gsm8k", "#### 72", "72")]
    )
    assert result.scores == [1.0, 0.0]


def test_unknown_data_source_is_a_config_error_naming_the_fix() -> None:
    with pytest.raises(
        ConfigError,
        match=r"no scorer for data_source 'math500' \(sample 1\); known: \['arithmetic', 'openai/gsm8k'\]",
    ):
        RewardManager().score([gsm("#### 72"), RewardSample("math500", "x", "1")])
    with pytest.raises(ConfigError, match="no scorer for data_source 'openai/gsm8k'"):
        RewardManager(include_builtin=False).score([gsm("#### 72")])


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("no_colon_here", "is not an import path"),
        ("megarl.rewards.nope:fn", "cannot import module 'megarl.rewards.nope'"),
        ("megarl.rewards.gsm8k:nope", "'megarl.rewards.gsm8k' has no attribute 'nope'"),
        ("megarl.rewards.gsm8k:METHODS", "'METHODS' is not callable"),
        ("/does/not/exist.py:fn", "file '/does/not/exist.py' does not exist"),
    ],
)
def test_bad_scorer_specs_fail_at_start_up(spec: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        RewardManager({"x": spec})


def test_a_scorer_file_that_fails_to_import_is_named(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ConfigError, match=r"broken\.py' failed to import: ModuleNotFoundError"):
        RewardManager({"x": f"{path}:fn"})


# ---- failures, in this process ----------------------------------------------------------------


def test_exceptions_score_zero_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    manager = RewardManager({"f": f"{MODULE}:failing_scorer"})
    with caplog.at_level(logging.WARNING, logger="megarl.rewards"):
        result = manager.score([RewardSample("f", "ok", None), RewardSample("f", "boom", None)])
    assert result.scores == [1.0, 0.0]
    assert result.metrics["reward/failures"] == 1.0 and result.metrics["reward/timeouts"] == 0.0
    assert [(o.index, o.status) for o in result.failures] == [(1, "error")]
    assert "RuntimeError: scorer exploded on purpose" in result.failures[0].message
    assert "1 of 2 samples failed" in caplog.text and "scorer exploded on purpose" in caplog.text
    assert manager.totals["failures"] == 1


def test_strict_mode_raises_on_the_first_failure() -> None:
    manager = RewardManager({"f": f"{MODULE}:failing_scorer"}, strict=True)
    with pytest.raises(
        RewardError, match=r"data_source 'f' failed on sample 0 \(error\): RuntimeError"
    ):
        manager.score([RewardSample("f", "boom", None)])


def test_bad_return_values_are_failures_and_dict_scores_are_read() -> None:
    manager = RewardManager({"o": f"{MODULE}:odd_returns"})
    result = manager.score([RewardSample("o", k, None) for k in ("nan", "text", "dict", "bool")])
    assert result.scores == [0.0, 0.0, 0.5, 1.0]
    assert [o.index for o in result.failures] == [0, 1]
    assert "return a finite float" in result.failures[0].message
    assert "scorer returned str" in result.failures[1].message


def test_in_process_timeout_interrupts_a_slow_scorer() -> None:
    manager = RewardManager({"s": f"{MODULE}:sleepy_scorer"}, timeout_s=0.2)
    handler_before = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    result = manager.score([RewardSample("s", "5", None), RewardSample("s", "0", None)])
    # interrupted, not waited for: the scorer sleeps 5 s (a bound of the sleep, not a speed claim,
    # so a loaded machine cannot fail it)
    assert time.monotonic() - start < 5.0
    assert result.scores == [0.0, 1.0]
    assert result.metrics["reward/timeouts"] == 1.0 and result.metrics["reward/failures"] == 1.0
    assert signal.getsignal(signal.SIGALRM) is handler_before, (
        "the previous SIGALRM handler is back"
    )
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0), "no timer left armed"


def test_in_process_scorers_may_be_plain_functions() -> None:
    manager = RewardManager({"l": lambda s, gt: float(s == gt)})
    assert manager.score([RewardSample("l", "a", "a")]).scores == [1.0]


# ---- failures, in worker processes ------------------------------------------------------------


def test_worker_pool_survives_exceptions_timeouts_hangs_and_crashes() -> None:
    manager = RewardManager(
        {
            "f": f"{MODULE}:failing_scorer",
            "s": f"{MODULE}:sleepy_scorer",
            "h": f"{MODULE}:stubborn_scorer",
            "c": f"{MODULE}:crashing_scorer",
        },
        num_workers=2,
        timeout_s=1.0,
        grace_s=0.5,
    )
    with manager:
        samples = [
            gsm("#### 72"),
            RewardSample("f", "boom", None),
            RewardSample("s", "30", None),  # interrupted by the soft timeout
            RewardSample("h", "30", None),  # ignores it: killed after the grace period
            RewardSample("c", "crash", None),  # kills its worker
            RewardSample("s", "0.1", None),
            gsm("#### 1"),
        ]
        start = time.monotonic()
        result = manager.score(samples)
        # The pool did not wait for the 30 s sleeps (two of them, on two workers): the bound is
        # the sleep itself, not a speed claim, so a loaded machine (15 s measured at load 43)
        # cannot fail it.
        assert time.monotonic() - start < 30
        assert result.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        status = {o.index: o.status for o in result.failures}
        assert status == {1: "error", 2: "timeout", 3: "timeout", 4: "error"}
        assert "killed" in next(o.message for o in result.failures if o.index == 3)
        assert "died (exit code 3)" in next(o.message for o in result.failures if o.index == 4)
        assert result.metrics["reward/failures"] == 4.0 and result.metrics["reward/timeouts"] == 2.0
        # the pool is whole again for the next batch
        assert manager.score([gsm("#### 72")] * 3).scores == [1.0] * 3


def test_worker_pool_needs_importable_scorers() -> None:
    with pytest.raises(ConfigError, match="cannot be imported by worker processes"):
        RewardManager({"l": lambda s, gt: 1.0}, num_workers=1)
    manager = RewardManager({"len": length_scorer}, num_workers=1)  # importable: sent by name
    with manager:
        assert manager.score([RewardSample("len", "abc", None)]).scores == [3.0]
