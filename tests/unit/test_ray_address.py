"""What --address means for --launcher ray, and the words of a refusal (no cluster involved)."""

from __future__ import annotations

import pytest

from megarl.cluster.ray_job import resolve_address
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
