"""scripts/prepare_preferences.py and megarl.tools.data_prep.preference_sources: pairs in the schema
PreferenceDataset reads, from hh-rlhf / ultrafeedback rows, local files and synthetic GSM."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data import PreferenceDataset
from megarl.rewards.gsm8k import compute_score
from megarl.tools.data_prep.common import PrepareError, iter_symbolic_problems, read_records
from megarl.tools.data_prep.preference_sources import (
    PREFERENCE_SCHEMA,
    PairFilter,
    build_splits,
    convert_records,
    detect_format,
    load_hub,
    parse_hh_transcript,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "prepare_preferences.py"


@functools.cache
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prepare_preferences", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["prepare_preferences"] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def char_tokenizer() -> Any:
    # PreTrainedTokenizerFast, not AutoTokenizer: the latter imports torch (~7 s of CPU here).
    from transformers import PreTrainedTokenizerFast

    from tests.assets import tiny_char_llama_dir

    return PreTrainedTokenizerFast.from_pretrained(tiny_char_llama_dir())


def hh(*turns: str) -> str:
    """An hh-rlhf transcript from alternating Human/Assistant turns."""
    return "".join(
        f"\n\n{'Human' if i % 2 == 0 else 'Assistant'}: {t}" for i, t in enumerate(turns)
    )


HH_ROWS = [
    {"chosen": hh("Hi, what is 2+2?", "4."), "rejected": hh("Hi, what is 2+2?", "5, I think.")},
    {
        "chosen": hh("Name a fruit.", "Apple.", "Another?", "Pear."),
        "rejected": hh("Name a fruit.", "Apple.", "Another?", "A car."),
    },
]

USER = {"role": "user", "content": "Say hi."}
ULTRA_ROWS = [
    # ultrafeedback_binarized: the prompt string and whole conversations
    {
        "prompt": "Say hi.",
        "chosen": [USER, {"role": "assistant", "content": "Hi!"}],
        "rejected": [USER, {"role": "assistant", "content": "No."}],
        "score_chosen": 9.0,
        "score_rejected": 2.0,
    },
    # replies alone, as messages
    {
        "prompt": "Count to 3.",
        "chosen": [{"role": "assistant", "content": "1 2 3"}],
        "rejected": [{"role": "assistant", "content": "1 3"}],
        "score_chosen": 8.0,
        "score_rejected": 1.0,
    },
]


def test_hh_rlhf_rows_split_into_shared_prompt_and_final_replies() -> None:
    assert parse_hh_transcript(hh("a", "b")) == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    dropped: Counter[str] = Counter()
    bad = [
        {"chosen": hh("q", "x"), "rejected": hh("other q", "y")},  # different prompts
        {"chosen": hh("q", "same"), "rejected": hh("q", "same")},
        {"chosen": hh("q", ""), "rejected": hh("q", "y")},
        {"chosen": "plain text", "rejected": "no turns"},
        {"chosen": hh("q", "a", "follow-up"), "rejected": hh("q", "a", "follow-up")},
    ]
    pairs = convert_records(HH_ROWS + bad, origin="hh", dropped=dropped)
    assert [(p.chosen, p.rejected) for p in pairs] == [("4.", "5, I think."), ("Pear.", "A car.")]
    assert pairs[0].prompt == [{"role": "user", "content": "Hi, what is 2+2?"}]
    assert [m["role"] for m in pairs[1].prompt] == ["user", "assistant", "user"]
    assert pairs[1].prompt[1]["content"] == "Apple."
    assert (pairs[0].data_source, pairs[0].ground_truth, pairs[0].origin) == (
        "Anthropic/hh-rlhf",
        None,
        "hh",
    )
    assert dropped == {
        "chosen and rejected differ before their last turn": 1,
        "identical replies": 1,
        "empty reply": 1,
        "not a '\\n\\nHuman: ... \\n\\nAssistant: ...' transcript": 1,
        "a conversation does not end with an assistant turn": 1,
    }
    with pytest.raises(PrepareError, match=r"record 0: column 'chosen' is list, not a string"):
        convert_records([{"chosen": [USER], "rejected": "x"}], origin="f", fmt="hh-rlhf")


def test_ultrafeedback_rows_take_the_reply_after_the_prompt() -> None:
    rows = [
        *ULTRA_ROWS,
        {"prompt": [USER], "chosen": "Hello.", "rejected": "Bye.", "data_source": "mine"},
    ]
    assert detect_format(rows[0], "x") == "ultrafeedback"
    pairs = convert_records(rows, origin="uf")
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        ([USER], "Hi!", "No."),
        ([{"role": "user", "content": "Count to 3."}], "1 2 3", "1 3"),
        ([USER], "Hello.", "Bye."),
    ]
    assert [p.data_source for p in pairs] == ["HuggingFaceH4/ultrafeedback_binarized"] * 2 + [
        "mine"
    ]
    dropped: Counter[str] = Counter()
    mismatch = {**ULTRA_ROWS[0], "prompt": "Something else."}
    two = {**ULTRA_ROWS[1], "chosen": [{"role": "assistant", "content": "1"}] * 2}
    assert convert_records([mismatch, two], origin="uf", dropped=dropped) == []
    assert dropped == {
        "the prompt column differs from the conversation's prompt turns": 1,
        "a reply is more than one assistant message": 1,
    }
    with pytest.raises(PrepareError, match=r"record 0: column 'rejected' is missing or null"):
        convert_records([{"prompt": "p", "chosen": "c", "rejected": None}], origin="f")
    with pytest.raises(PrepareError, match=r"record 0.*column 'chosen' holds int"):
        convert_records([{"prompt": "p", "chosen": 3, "rejected": "r"}], origin="f")
    with pytest.raises(PrepareError, match=r"no column 'rejected'.*needs 'chosen' and 'rejected'"):
        detect_format(["prompt", "chosen"], "f.jsonl")


def test_local_files_in_both_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # one hh-rlhf jsonl file: split into train and test by --test-size
    many = [
        {"chosen": hh(f"q{i}?", f"good {i}"), "rejected": hh(f"q{i}?", f"bad {i}")}
        for i in range(12)
    ]
    jsonl = tmp_path / "hh.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in many))
    out = tmp_path / "out"
    assert script().main(["--out", str(out), "--source", str(jsonl), "--test-size", "3"]) == 0
    printed = capsys.readouterr().out
    assert (
        f"train: 9 rows [prompt, chosen, rejected, data_source, ground_truth, extra_info] -> {out / 'train.parquet'}"
        in printed
    )
    train = pq.read_table(out / "train.parquet")
    test = pq.read_table(out / "test.parquet")
    assert train.schema.equals(PREFERENCE_SCHEMA) and test.num_rows == 3
    both = train.to_pylist() + test.to_pylist()
    assert sorted(r["prompt"][0]["content"] for r in both) == sorted(f"q{i}?" for i in range(12))
    assert all(r["chosen"].startswith("good") and r["rejected"].startswith("bad") for r in both)
    assert [r["extra_info"]["index"] for r in test.to_pylist()] == [0, 1, 2]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "no temporary files"

    # a folder of ultrafeedback-style parquet files (message lists), and a .json list
    folder = tmp_path / "uf"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(ULTRA_ROWS), folder / "train_prefs-00000-of-00001.parquet")
    (folder / "test.json").write_text(json.dumps([ULTRA_ROWS[1]]))
    written = script().prepare(tmp_path / "out2", str(folder), max_chars=100)
    rows = {s: pq.read_table(path).to_pylist() for s, (path, _) in written.items()}
    assert [r["chosen"] for r in rows["train"]] == ["Hi!", "1 2 3"]
    assert rows["test"][0]["prompt"] == [{"role": "user", "content": "Count to 3."}]
    assert rows["train"][0]["extra_info"]["origin"].endswith("train_prefs-00000-of-00001.parquet")
    # the written files read back as a local source (prompt/chosen/rejected rows)
    again = build_splits(str(tmp_path / "out2" / "train.parquet"), test_size=1)
    assert sorted(p.chosen for s in again.values() for p in s.pairs) == ["1 2 3", "Hi!"]
    assert read_records(folder / "test.json") == [ULTRA_ROWS[1]]


def test_bad_inputs_fail_with_a_message_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main = script().main
    out = str(tmp_path / "o")

    def error(*args: str) -> str:
        assert main(["--out", out, *args]) == 2
        return capsys.readouterr().err

    assert "not one of hh-rlhf, ultrafeedback, synthetic-gsm and no such file" in error(
        "--source", "nope"
    )
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    assert "no column 'chosen', 'rejected'; the columns are ['answer', 'question']" in error(
        "--source", str(wrong)
    )
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in HH_ROWS))
    err = error("--source", str(pairs), "--max-chars", "5")
    assert "no train pairs left (dropped: 2 over --max-chars 5); raise --max-chars" in err
    assert "--test-size 2 leaves no training pairs" in error(
        "--source", str(pairs), "--test-size", "2"
    )
    assert "--easy applies to --source synthetic-gsm only" in error(
        "--source", str(pairs), "--easy"
    )
    assert "--train-size must be >= 1" in error("--source", "synthetic-gsm", "--train-size", "0")
    err = error("--source", "synthetic-gsm", "--train-size", "1", "--max-chars", "50")
    assert "synthetic-gsm: only 0 of 1 train pairs" in err and "raise --max-chars" in err
    assert not (tmp_path / "o").exists(), "nothing is written when preparation fails"


def test_hub_sources_without_a_hub_point_at_the_offline_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(PrepareError) as e:
        load_hub("hh-rlhf", "train")
    assert "needs the `datasets` or `huggingface_hub` package" in str(e.value)
    assert "--source PATH" in str(e.value) and "--source synthetic-gsm" in str(e.value)

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("Name or service not known")

    fake = types.SimpleNamespace(hf_hub_download=unreachable, list_repo_files=unreachable)
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    for source, what in (
        ("hh-rlhf", "Anthropic/hh-rlhf [test]"),
        ("ultrafeedback", "HuggingFaceH4/ultrafeedback_binarized [test_prefs]"),
    ):
        with pytest.raises(PrepareError) as e:
            load_hub(source, "test")
        assert f"could not load {what} from the hub (ConnectionError" in str(e.value)
        assert "--source synthetic-gsm" in str(e.value)


@functools.cache
def synthetic(easy: bool, seed: int = 5) -> dict[str, list[dict[str, Any]]]:
    splits = build_splits(
        "synthetic-gsm",
        train_size=24,
        test_size=8,
        seed=seed,
        easy=easy,
        pair_filter=PairFilter(max_chars=440, ascii_only=True),
    )
    return {s: [p.to_row(s, i) for i, p in enumerate(r.pairs)] for s, r in splits.items()}


@pytest.mark.parametrize("easy", [False, True], ids=["wrong-final", "easy"])
def test_synthetic_gsm_pairs_are_verifiably_ordered(easy: bool) -> None:
    data = synthetic(easy)
    assert (len(data["train"]), len(data["test"])) == (24, 8)
    for rows in data.values():
        for r in rows:
            truth = r["ground_truth"]
            assert r["data_source"] == "openai/gsm8k" and str(int(truth)) == truth
            assert compute_score(r["chosen"], truth) == 1.0
            assert compute_score(r["rejected"], truth) == 0.0
            prompt_chars = len(r["prompt"][0]["content"])
            assert prompt_chars + max(len(r["chosen"]), len(r["rejected"])) <= 440
            assert r["prompt"][0]["content"].isascii() and r["chosen"].isascii()
            if easy:
                assert r["chosen"] == f"The answer is {truth}.\n#### {truth}"
                assert not any(ch.isdigit() for ch in r["rejected"])
                assert abs(len(r["chosen"]) - len(r["rejected"])) <= 20
            else:
                # same reasoning, same length: only the final number differs
                head_c, last_c = r["chosen"].rsplit("\n", 1)
                head_r, last_r = r["rejected"].rsplit("\n", 1)
                assert head_c == head_r and len(head_c) > 20
                assert len(r["chosen"]) == len(r["rejected"])
                assert last_c == f"#### {truth}"
                assert 1 <= abs(int(last_r.removeprefix("#### ")) - int(truth)) <= 3
    templates = {
        s: {r["extra_info"]["origin"].split(":")[0] for r in rows} for s, rows in data.items()
    }
    assert templates["train"].isdisjoint(templates["test"]), "test uses held-out templates"
    # deterministic for a seed, different for another
    assert synthetic(easy, 5) == synthetic(easy, 5)
    other = build_splits("synthetic-gsm", train_size=24, test_size=8, seed=6, easy=easy)
    assert [p.prompt for p in other["train"].pairs] != [r["prompt"] for r in data["train"]]


def test_symbolic_problems_are_those_of_prepare_gsm8k() -> None:
    from tests.unit.test_prepare_gsm8k import prepare_module

    rows = prepare_module().generate_symbolic(15, 3, "test")
    problems = list(iter_symbolic_problems(3, "test", 1000))[:15]
    assert [(r["extra_info"]["question"], r["extra_info"]["answer"]) for r in rows] == [
        (p.question, p.solution) for p in problems
    ]
    assert [r["reward_model"]["ground_truth"] for r in rows] == [str(p.answer) for p in problems]


def test_preference_dataset_reads_the_written_files(tmp_path: Path) -> None:
    tok = char_tokenizer()
    for easy in (False, True):
        table = pa.Table.from_pylist(synthetic(easy)["train"], schema=PREFERENCE_SCHEMA)
        path = tmp_path / f"train-{easy}.parquet"
        pq.write_table(table, path)
        ds = PreferenceDataset(str(path), tok, batch_size_per_rank=8, max_length=512, shuffle=False)
        items = [item for batch in ds for item in batch]
        assert len(items) == 24 and ds.metrics()["data/filtered_pairs"] == 0
        rows = synthetic(easy)["train"]
        for item, row in zip(items, rows, strict=True):
            assert tok.decode(item.chosen_ids) == row["chosen"] + "<|im_end|>\n"
            assert tok.decode(item.rejected_ids) == row["rejected"] + "<|im_end|>\n"
            assert item.extra["ground_truth"] == row["ground_truth"]
            assert len(item.prompt_ids) + max(len(item.chosen_ids), len(item.rejected_ids)) <= 512


def test_command_line(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in ULTRA_ROWS * 3))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--source", str(pairs)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    columns = "[prompt, chosen, rejected, data_source, ground_truth, extra_info]"
    assert f"train: 5 rows {columns} -> {out / 'train.parquet'}" in proc.stdout
    assert f"test: 1 rows {columns} -> {out / 'test.parquet'}" in proc.stdout
    assert "5 pairs available, dropped: none" in proc.stdout
    assert pq.read_table(out / "test.parquet").schema.equals(PREFERENCE_SCHEMA)


def test_json_lines_keep_unicode_line_separators_inside_strings(tmp_path):
    from megarl.tools.data_prep.common import read_records

    path = tmp_path / "rows.jsonl"
    path.write_text('{"q": "a\u2028b"}\r\n{"q": "c\u0085d"}\n\n', encoding="utf-8")
    assert read_records(path) == [{"q": "a\u2028b"}, {"q": "c\u0085d"}]
