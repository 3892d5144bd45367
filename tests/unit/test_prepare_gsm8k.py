"""scripts/prepare_gsm8k.py: verl-schema parquet from GSM-Symbolic (offline) or a local GSM8K copy."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pyarrow.parquet as pq
import pytest

from megarl.rewards.gsm8k import compute_score

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "prepare_gsm8k.py"


@functools.cache
def prepare_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["prepare_gsm8k"] = module
    spec.loader.exec_module(module)
    return module


def test_gsm_symbolic_writes_the_rl_schema_with_integer_answers(tmp_path: Path) -> None:
    paths = prepare_module().prepare(
        tmp_path, "gsm-symbolic", train_size=60, test_size=25, seed=3, row_group_size=16
    )
    assert paths == {"train": tmp_path / "train.parquet", "test": tmp_path / "test.parquet"}
    train, test = (pq.read_table(paths[s]).to_pylist() for s in ("train", "test"))
    assert (len(train), len(test)) == (60, 25)
    assert pq.ParquetFile(paths["train"]).metadata.num_row_groups == 4
    for split, rows in (("train", train), ("test", test)):
        for i, row in enumerate(rows):
            assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
            assert row["prompt"][0]["role"] == "user" and len(row["prompt"]) == 1
            assert '"####"' in row["prompt"][0]["content"]
            truth = row["reward_model"]["ground_truth"]
            assert row["reward_model"]["style"] == "rule" and str(int(truth)) == truth
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == i
            # the worked solution ends in GSM8K's format and scores full marks on its own answer
            assert compute_score(row["extra_info"]["answer"], truth) == 1.0
    train_templates = {r["extra_info"]["origin"] for r in train}
    test_templates = {r["extra_info"]["origin"] for r in test}
    assert train_templates.isdisjoint(test_templates), "test problems come from held-out templates"


def test_gsm_symbolic_is_deterministic_per_seed(tmp_path: Path) -> None:
    prep = prepare_module()
    a = prep.prepare(tmp_path / "a", "gsm-symbolic", train_size=10, test_size=5, seed=1)
    b = prep.prepare(tmp_path / "b", "gsm-symbolic", train_size=10, test_size=5, seed=1)
    c = prep.prepare(tmp_path / "c", "gsm-symbolic", train_size=10, test_size=5, seed=2)
    assert pq.read_table(a["train"]).equals(pq.read_table(b["train"]))
    assert not pq.read_table(a["train"]).equals(pq.read_table(c["train"]))


def test_the_quickstart_names_its_toy_task_in_data_source(tmp_path: Path) -> None:
    """The quickstart's prompts are GSM-Symbolic but its reward is the vowel toy: its rows say so,
    so validation reports `val/toy/vowels/...`, not a GSM8K score."""
    from megarl.tools import quickstart

    prep = prepare_module()
    recipe = quickstart.RECIPES["vowels"]
    assert recipe.data_source == "toy/vowels"
    assert quickstart.RECIPES["gsm"].data_source == prep.GSM8K_DATA_SOURCE
    argv = ["--out", str(tmp_path), "--source", "gsm-symbolic", "--train-size", "3"]
    assert prep.main([*argv, "--test-size", "2", "--data-source", recipe.data_source]) == 0
    for split in ("train", "test"):
        assert set(pq.read_table(tmp_path / f"{split}.parquet")["data_source"].to_pylist()) == {
            "toy/vowels"
        }
    with pytest.raises(prep.PrepareError, match="--data-source must not be empty"):
        prep.prepare(tmp_path / "x", "gsm-symbolic", train_size=1, test_size=1, data_source="")


def _write_gsm8k_jsonl(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    train = [
        {
            "question": "Tom has 2 apples and buys 3. How many?",
            "answer": "2 + 3 = <<2+3=5>>5\n#### 5",
        },
        {
            "question": "A car costs $1,200 more than 300. Price?",
            "answer": "300 + 1200 = 1500\n#### 1,500",
        },
        {"question": "Temperature 4 minus 9?", "answer": "4 - 9 = -5\n#### -5"},
    ]
    test = [{"question": "What is 6 * 7?", "answer": "6 * 7 = 42\n#### 42"}]
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_local_gsm8k_copy_keeps_questions_and_integer_truths(tmp_path: Path) -> None:
    _write_gsm8k_jsonl(tmp_path / "gsm8k")
    assert (
        prepare_module().main(["--out", str(tmp_path / "out"), "--source", str(tmp_path / "gsm8k")])
        == 0
    )
    train = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in train] == ["5", "1500", "-5"]
    assert train[1]["prompt"][0]["content"].startswith("A car costs $1,200 more than 300. Price? ")
    assert train[0]["extra_info"]["origin"] == "gsm8k"
    assert (
        prepare_module().main(
            [
                "--out",
                str(tmp_path / "small"),
                "--source",
                str(tmp_path / "gsm8k"),
                "--train-size",
                "2",
            ]
        )
        == 0
    )
    assert pq.ParquetFile(tmp_path / "small" / "train.parquet").metadata.num_rows == 2


def test_bad_sources_fail_with_a_message_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main = prepare_module().main
    assert main(["--out", str(tmp_path / "o"), "--source", str(tmp_path / "missing")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    bad = tmp_path / "bad"
    _write_gsm8k_jsonl(bad)
    (bad / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    assert main(["--out", str(tmp_path / "o"), "--source", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "test.jsonl: record 0: column 'answer' does not end in '#### <integer>'" in err
    (bad / "test.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    assert main(["--out", str(tmp_path / "o"), "--source", str(bad)]) == 2
    assert "record 0 has no string column 'answer'" in capsys.readouterr().err
    assert (
        main(["--out", str(tmp_path / "o"), "--source", "gsm-symbolic", "--train-size", "0"]) == 2
    )
    assert "--train-size must be >= 1" in capsys.readouterr().err


def test_hub_source_without_datasets_points_at_the_offline_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: never touch a hub
    assert prepare_module().main(["--out", str(tmp_path), "--source", "hub"]) == 2
    err = capsys.readouterr().err
    assert "needs the `datasets` package" in err and "--source gsm-symbolic" in err


def test_command_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--out",
            str(tmp_path),
            "--source",
            "gsm-symbolic",
            "--train-size",
            "8",
            "--test-size",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "train: 8 rows" in proc.stdout and "test: 4 rows" in proc.stdout
