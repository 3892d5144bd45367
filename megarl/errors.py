"""Errors a user can cause. The CLI prints their message (which names the fix) and exits with 2."""

from __future__ import annotations


class MegarlError(Exception):
    """Base of every error caused by user input: bad config, bad files, impossible layouts."""

    exit_code = 2


class ConfigError(MegarlError):
    """A setting or combination of settings that cannot work."""


class LayoutError(ConfigError):
    """A TP/PP/DP layout that does not fit the model or the world size."""


class CheckpointError(MegarlError):
    """A checkpoint (HF safetensors or Megatron dist checkpoint) that is missing, partial or corrupt."""


class UnsupportedModelError(MegarlError):
    """A Hugging Face architecture megarl has no spec for."""


class LaunchError(MegarlError):
    """A job that cannot be started where it was asked to run (a cluster that does not answer,
    lacks the resources, or cannot place the ranks)."""
