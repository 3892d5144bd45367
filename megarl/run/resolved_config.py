"""The run folder keeps the config the run resolved: ``OUT/config.yaml``, every setting (the
defaults, the YAML file and the overrides merged), written atomically by rank 0 at start (again at
each resume: the settings the resumed run used). ``megarl train OUT/config.yaml`` runs it again."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from megarl import __version__
from megarl.config import RunConfig
from megarl.files import replace_file

CONFIG_FILE = "config.yaml"


def resolved_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def write_resolved_config(cfg: RunConfig, rank: int) -> Path | None:
    """Rank 0 writes ``trainer.output_dir/config.yaml``; the path, or None on other ranks."""
    if rank != 0:
        return None
    folder = Path(cfg.trainer.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    header = (
        f"# The resolved config of this run (megarl {__version__}), written at its start.\n"
        f"# `megarl train {folder / CONFIG_FILE}` runs it again (resuming in this folder).\n"
    )
    return replace_file(folder / CONFIG_FILE, header + resolved_yaml(cfg))
