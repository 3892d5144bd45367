"""The names the issue made the interface: ``megarl --version``, ``megarl config --show [CONFIG]
[overrides]`` (every setting, its value and its default) and the run folder's ``config.yaml``."""

from __future__ import annotations

import pytest

import megarl
from megarl.cli import main as cli_main
from megarl.config import load_config
from megarl.config.show import leaf_keys
from megarl.run.resolved_config import CONFIG_FILE, write_resolved_config

pytestmark = pytest.mark.unit

YAML = "model:\n  path: /m\ndata:\n  train_files: [/d.parquet]\nrollout:\n  n: 8\n"


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"megarl {megarl.__version__}"


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines()[2:]:
        mark, key, *rest = line[:1], *line[2:].split()
        rows[key] = [mark, *rest]
    return rows


def test_config_show_prints_every_setting_with_its_value_and_default(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(YAML)
    assert cli_main(["config", "--show", str(config), "actor.optim.lr=0.5"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert list(rows) == leaf_keys() and len(rows) > 150  # every setting, in the schema's order
    assert rows["rollout.sampling.n"] == ["*", "8", "5"]  # from the file; default 5
    assert rows["actor.optim.lr"] == ["*", "0.5", "1e-06"]  # from the overrides
    assert rows["model.path"] == ["*", "/m", "(required)"]
    assert rows["parallel.tp"] == [" ", "1", "1"]
    # no file: the defaults (overrides alone work too); an unknown key is refused as in train
    assert cli_main(["config", "--show", "rollout.sampling.n=3"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["rollout.sampling.n"] == ["*", "3", "5"] and rows["model.path"][1] == "(required)"
    assert cli_main(["config", "--show", "rollout.nn=3"]) == 2
    assert "did you mean rollout.sampling.n" in capsys.readouterr().err


def test_the_run_folder_keeps_the_resolved_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(YAML)
    cfg = load_config(config, [f"trainer.output_dir={tmp_path / 'out'}", "trainer.save_freq=-1"])
    assert write_resolved_config(cfg, rank=1) is None  # rank 0 writes it
    path = write_resolved_config(cfg, rank=0)
    assert path == tmp_path / "out" / CONFIG_FILE
    assert path.read_text().startswith("# The resolved config of this run")
    assert load_config(path) == cfg  # every setting, runnable again as it is
    assert not [p for p in path.parent.iterdir() if p.name != CONFIG_FILE]  # no temporary left


def test_docs_list_every_setting_generated_from_the_schema():
    from pathlib import Path

    from megarl.config.show import markdown

    docs = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    generated = markdown()
    assert docs.read_text() == generated, (
        "docs/configuration.md is behind the schema: python -m megarl.config.show > "
        "docs/configuration.md"
    )
    assert all(f"| `{key}` |" in generated for key in leaf_keys())
