"""What --address means for --launcher ray, and the words of a refusal (no cluster involved)."""

from __future__ import annotations

import signal
import types

import pytest

from megarl.cluster import placement
from megarl.cluster.ray_job import INTERRUPTED_EXIT_CODE, RayLauncher, _Rank, resolve_address
from megarl.cluster.start import world_size
from megarl.errors import ConfigError


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
