"""What --address means for --launcher ray, and the words of a refusal (no cluster involved)."""

from __future__ import annotations

import signal
import types

import pytest

from megarl.cluster import placement, ray_job
from megarl.cluster.rank_agent import Poll
from megarl.cluster.ray_job import INTERRUPTED_EXIT_CODE, RayLauncher, _Rank, resolve_address
from megarl.cluster.start import world_size
from megarl.errors import ConfigError
from megarl.rank_exit import PEER_LOST_EXIT


def test_addresses(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no cluster started on this "machine"
    assert resolve_address(None) == "local"  # a new local instance, never someone else's
    assert resolve_address("10.0.0.1:6379") == "10.0.0.1:6379"
    with pytest.raises(ConfigError, match="no Ray cluster was started on this machine"):
        resolve_address("auto")
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.2:6379\n")
    assert resolve_address("auto") == "10.0.0.2:6379"  # what `ray start --head` left here
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.3:6379")  # inside `ray job submit`
    assert resolve_address(None) == resolve_address("auto") == "10.0.0.3:6379"
    for bad, message in (
        ("ray://10.0.0.1:10001", "Ray Client addresses are not supported"),
        ("http://10.0.0.1:8265", "is the address of Ray's dashboard"),
        ("10.0.0.1", "must be auto or HOST:PORT"),
    ):
        with pytest.raises(ConfigError, match=message):
            resolve_address(bad)


def test_launcher_options():
    assert world_size("ray", 2, 8, "auto") == 16
    assert world_size("torchrun", None, 4, None) == 4
    with pytest.raises(ConfigError, match="--address is an option of --launcher ray"):
        world_size("torchrun", None, 4, "auto")
    with pytest.raises(ConfigError, match="starts ranks on this machine only"):
        world_size("torchrun", 2, 4, None)
    with pytest.raises(ConfigError, match="--nproc-per-node 0 must be >= 1"):
        world_size("ray", 1, 0, None)


class _FakeRay:
    """The few Ray calls the driver's constructor and signal path make; no cluster."""

    def cluster_resources(self):
        return {"CPU": 4.0}

    def get_runtime_context(self):
        return types.SimpleNamespace(get_node_id=lambda: "node-0")


class _FakeAgent:
    def __init__(self):
        self.sent: list[int] = []
        self.send_signal = types.SimpleNamespace(remote=self.sent.append)


def _driver_after(signals: list[int]) -> tuple[RayLauncher, list[_Rank]]:
    driver = RayLauncher(_FakeRay(), "local", one_node=True, verbose=False, local=True)
    node = placement.NodeSlots("node-0", "127.0.0.1", 4)
    ranks = [_Rank(_FakeAgent(), node, i) for i in range(3)]
    ranks[2].lost = "its node is gone"
    for s in signals:
        driver._on_signal(s, None)
    driver._forward_pending(ranks)
    return driver, ranks


def test_the_ray_driver_passes_preemption_and_ctrl_c_to_every_live_rank(capsys):
    """SIGTERM (a scheduler's preemption) reaches the ranks as SIGUSR1, the preemption signal
    they finish the step and checkpoint on (the e2e Ctrl-C run and test_sigterm_* under torchrun
    check the ranks' side), and the job then ends 0; a Ctrl-C reaches them as SIGUSR2 and ends 130.
    A lost rank gets nothing."""
    driver, ranks = _driver_after([signal.SIGTERM])
    assert [r.agent.sent for r in ranks] == [[signal.SIGUSR1], [signal.SIGUSR1], []]
    assert driver.interrupted and driver._first_signal == signal.SIGTERM
    assert "SIGTERM received: asking the 3 ranks" in capsys.readouterr().err
    driver, ranks = _driver_after([signal.SIGINT, signal.SIGINT])  # the second stops at once
    assert ranks[0].agent.sent == [signal.SIGUSR2, signal.SIGUSR2]
    assert driver._first_signal == signal.SIGINT
    assert INTERRUPTED_EXIT_CODE == 130


class _ScriptedAgent:
    """A rank agent whose polls answer from a script: one Poll per call, the last one repeated."""

    def __init__(self, polls: list[Poll]):
        self._polls = polls
        self.poll = types.SimpleNamespace(remote=self._next)
        self.stop = types.SimpleNamespace(remote=lambda: Poll(b"", b"", None, None))
        self.send_signal = types.SimpleNamespace(remote=lambda s: None)

    def _next(self) -> Poll:
        return self._polls.pop(0) if len(self._polls) > 1 else self._polls[0]


class _ImmediateRay(_FakeRay):
    def get(self, value, timeout=None):
        return value


def _watched(script: list[list[Poll]]):
    driver = RayLauncher(_ImmediateRay(), "local", one_node=True, verbose=False, local=True)
    node = placement.NodeSlots("node-0", "127.0.0.1", 4)
    ranks = [_Rank(_ScriptedAgent(polls), node, i) for i, polls in enumerate(script)]
    return driver._watch(ranks)


RUNNING = Poll(b"", b"", None, None)


def test_the_ray_driver_blames_the_killed_rank_that_a_poll_saw_after_its_peers(capsys):
    """CI saw it: rank 3 answered a poll as running just before it was SIGKILLed, and rank 2, left
    alone in a collective, answered the same poll with its exit for a lost peer. The driver polls
    again while only such consequences are seen, and names rank 3."""
    killed = Poll(b"", b"", -signal.SIGKILL, 12.0)
    peer_lost = Poll(b"", b"", PEER_LOST_EXIT, 11.5)
    result = _watched([[RUNNING], [RUNNING], [peer_lost], [RUNNING, killed]])
    assert (result.failed_rank, result.how) == (3, "was killed by SIGKILL"), result
    assert "megarl: rank 3 was killed by SIGKILL" in capsys.readouterr().err


def test_the_ray_driver_reports_a_lost_peer_once_the_grace_is_over(monkeypatch, capsys):
    monkeypatch.setattr(ray_job, "CAUSE_GRACE_S", 0.3)
    peer_lost = Poll(b"", b"", PEER_LOST_EXIT, 11.5)
    result = _watched([[RUNNING], [peer_lost]])  # rank 0 never ends: no cause ever shows
    assert (result.failed_rank, result.how) == (1, "exited with code 3"), result
