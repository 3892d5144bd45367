"""bench/process_env.py: a bench's peer process gets the malloc settings megarl's launcher gives
its CPU ranks, and the record of both sides' settings says they are the same."""

from __future__ import annotations

import sys

import pytest

from bench.process_env import megarl_rank_settings, peer_env, process_settings
from megarl.host_allocator import CPU_ALLOCATOR_ENV

pytestmark = pytest.mark.unit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's variables: Linux only")
def test_the_peer_gets_megarls_malloc_settings_and_the_threads():
    env = peer_env(3, {"PATH": "/bin", "MASTER_PORT": "1234"})
    assert {k: env[k] for k in CPU_ALLOCATOR_ENV} == CPU_ALLOCATOR_ENV
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert "MASTER_PORT" not in env and env["PATH"] == "/bin"
    assert process_settings(env) == megarl_rank_settings(env)


def test_a_users_setting_wins_on_both_sides():
    env = peer_env(2, {"MALLOC_MMAP_MAX_": "65536", "MALLOC_ARENA_MAX": "2"})
    settings = process_settings(env)
    assert settings["MALLOC_MMAP_MAX_"] == "65536" and settings["MALLOC_ARENA_MAX"] == "2"
    assert megarl_rank_settings(env) == settings


def test_unset_variables_are_recorded_as_none():
    settings = process_settings({})
    assert set(settings) >= {*CPU_ALLOCATOR_ENV, "OMP_NUM_THREADS", "MKL_NUM_THREADS"}
    assert all(v is None for v in settings.values())
