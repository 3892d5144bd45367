"""The quiet console's decisions: the ranks' environment, the known warnings it hides, what the
launcher adds after a failed rank and its exit code; `megarl demo`'s exit code on a mismatch."""

from __future__ import annotations

import warnings

import pytest

from megarl import console
from megarl.rank_exit import exit_code_of, failure_note
from megarl.tools.demo import parity_verdict

pytestmark = pytest.mark.unit


def test_rank_env_is_quiet_unless_verbose_and_keeps_what_the_user_set(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    quiet = console.rank_env(verbose=False)
    assert quiet["MEGARL_VERBOSE"] == "0" and quiet["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert "TORCH_CPP_LOG_LEVEL" not in quiet  # the user's own choice stays
    assert console.rank_env(verbose=True) == {"MEGARL_VERBOSE": "1"}


def _warnings_shown(verbose: bool, monkeypatch) -> list[str]:
    monkeypatch.setenv("MEGARL_VERBOSE", "1" if verbose else "0")
    for key in console.QUIET_ENV:  # set, then removed: monkeypatch restores the original after
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet_rank_console()
        warnings.warn(
            "`torch.distributed.reduce_op` is deprecated, please use ReduceOp",
            FutureWarning,
            stacklevel=2,
        )
        warnings.warn(
            "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
            stacklevel=2,
        )
        warnings.warn("an unknown deprecation", FutureWarning, stacklevel=2)
    return [str(w.message) for w in caught]


def test_known_warnings_are_hidden_only_when_quiet(monkeypatch):
    assert _warnings_shown(False, monkeypatch) == ["an unknown deprecation"]
    assert len(_warnings_shown(True, monkeypatch)) == 3


def test_launcher_keeps_the_ranks_exit_code_and_adds_nothing_after_a_megarl_error():
    assert failure_note(0, 2) is None  # the rank's "megarl: error: ..." stays the last line
    assert failure_note(3, 1) == (
        "megarl: rank 3 exited with code 1; its output is above (--verbose shows torchrun's report)"
    )
    assert "rank 1 was killed by SIGKILL" in failure_note(1, -9)
    assert [exit_code_of(c) for c in (2, 1, -9, -15)] == [2, 1, 137, 143]


def test_demo_exit_code_follows_the_parity_verdict():
    first_stage = {"rank": 0, "layout": "TP2xPP2xDP1"}  # no logits on a first PP stage
    close = {"max_abs_logit_diff": 3e-7, "max_abs_logit": 4.0}
    far = {"max_abs_logit_diff": 1e-2, "max_abs_logit": 4.0}
    assert parity_verdict([first_stage, close]) == (True, 3e-7)
    ok, worst = parity_verdict([first_stage, close, far])
    assert not ok and worst == 1e-2
    assert parity_verdict([first_stage])[0] is False  # nothing compared is not a pass
