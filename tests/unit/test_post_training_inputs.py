"""The post-training trainers' bad input stops at the command line with one clear line and exit
code 2, before any process starts (data columns, DPO reference, distillation teacher, settings);
their micro-batch rows and the token accuracy are checked against plain torch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from megarl.algos import vocab_parallel_is_argmax
from megarl.cli import main
from megarl.run.sequences import length_groups, token_rows
from tests.assets import qwen25_tokenizer_dir, tiny_char_llama_dir, tiny_chat_llama_dir


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("inputs")
    prompt = [{"role": "user", "content": "hi"}]
    pq.write_table(
        pa.Table.from_pylist([{"prompt": prompt, "response": "ok"}] * 4), work / "sft.parquet"
    )
    pq.write_table(
        pa.Table.from_pylist([{"prompt": prompt, "chosen": "a", "rejected": "b"}] * 4),
        work / "prefs.parquet",
    )
    rl = {"prompt": prompt, "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "1"}}
    pq.write_table(pa.Table.from_pylist([rl] * 4), work / "prompts.parquet")
    model = str(tiny_char_llama_dir())
    base = {"model": {"path": model}, "data": {"train_batch_size": 2}}
    for name, kind, data in (
        ("sft", "sft", "sft"),
        ("dpo", "dpo", "prefs"),
        ("grpo", "policy", "prompts"),
    ):
        cfg = {**base, "trainer": {"kind": kind}, "actor": {"ppo_mini_batch_size": 2}}
        cfg["data"] = {**base["data"], "train_files": [str(work / f"{data}.parquet")]}
        (work / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    # a teacher of another tokenizer: the tiny Llama with the Qwen2.5 vocabulary's files
    other = work / "other_tokenizer"
    shutil.copytree(tiny_char_llama_dir(), other)
    for f in other.glob("tokenizer*"):
        f.unlink()
    for f in Path(qwen25_tokenizer_dir()).iterdir():
        shutil.copy(f, other / f.name)
    return work


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2, argv
    return capsys.readouterr().err


def test_data_without_the_trainers_columns_fails_before_launch(work, capsys):
    err = _error(
        capsys, ["train-sft", str(work / "sft.yaml"), f"data.train_files=[{work}/prefs.parquet]"]
    )
    assert "prefs.parquet: an SFT file needs a 'messages' column" in err
    assert "['chosen', 'prompt', 'rejected']" in err
    err = _error(
        capsys, ["train-dpo", str(work / "dpo.yaml"), f"data.val_files=[{work}/sft.parquet]"]
    )
    assert "sft.parquet: missing column 'chosen'" in err
    err = _error(
        capsys, ["train", str(work / "grpo.yaml"), f"data.train_files=[{work}/sft.parquet]"]
    )
    assert "sft.parquet: missing column 'data_source'" in err


def test_bad_dpo_references_fail_before_launch(work, capsys):
    dpo = str(work / "dpo.yaml")
    err = _error(capsys, ["train-dpo", dpo, f"dpo.reference_path={work}/none"])
    assert "dpo.reference_path: model folder" in err and "does not exist" in err
    err = _error(capsys, ["train-dpo", dpo, f"dpo.reference_path={work}/other_tokenizer"])
    assert "has another tokenizer than model.path" in err
    err = _error(capsys, ["train-dpo", dpo, "dpo.loss=nope"])
    assert "dpo.loss='nope' is not a registered DPO loss; known: hinge, ipo, robust, sigmoid" in err
    err = _error(capsys, ["train-dpo", dpo, "dpo.loss=simpo", f"dpo.reference_path={work}/x"])
    assert "reference-free" in err


def test_bad_teachers_fail_before_launch(work, capsys):
    grpo = str(work / "grpo.yaml")
    err = _error(capsys, ["train", grpo, f"algorithm.distill.teacher_path={work}/other_tokenizer"])
    assert "algorithm.distill.teacher_path=" in err and "has another tokenizer" in err
    err = _error(capsys, ["train", grpo, f"algorithm.distill.teacher_path={tiny_chat_llama_dir()}"])
    assert "has another tokenizer" in err  # SmolLM2's vocabulary, not the character one
    err = _error(capsys, ["train", grpo, "algorithm.distill.mode=forward"])
    assert "algorithm.distill.mode='forward' is not one of ['reward', 'loss']" in err
    teacher = f"algorithm.distill.teacher_path={tiny_char_llama_dir()}"
    err = _error(capsys, ["train", grpo, teacher, "algorithm.distill.coef=0"])
    assert "algorithm.distill.coef=0.0 must be > 0" in err
    reward = work / "reward_teacher"
    if not reward.exists():
        shutil.copytree(tiny_char_llama_dir(), reward)
        cfg = json.loads((reward / "config.json").read_text())
        cfg.update(architectures=["LlamaForSequenceClassification"], num_labels=1)
        (reward / "config.json").write_text(json.dumps(cfg))
    err = _error(capsys, ["train", grpo, f"algorithm.distill.teacher_path={reward}"])
    assert "is not a causal language model" in err


def test_a_checkpoint_of_another_trainer_is_refused(work, tmp_path, capsys):
    from megarl.run import trainer_state

    ckpt = tmp_path / "checkpoints" / "step_00000002"
    (ckpt / "actor").mkdir(parents=True)
    (ckpt / "trainer").mkdir()
    trainer_state.write(ckpt / "trainer", {"step": 2, "kind": "sft", "roles": ["actor"]})
    (tmp_path / "checkpoints" / "latest").write_text("step_00000002\n")
    from megarl.config import load_config
    from megarl.errors import CheckpointError
    from megarl.run.resume import resume_point

    cfg = load_config(work / "dpo.yaml", [f"trainer.output_dir={tmp_path}"])
    import megarl.run.checkpointing as checkpointing

    original = checkpointing.check_resume
    checkpointing.check_resume = lambda path, roles, paths: {}  # the models are not the point
    try:
        with pytest.raises(
            CheckpointError,
            match=r"written by a trainer\.kind=sft run and this run is trainer\.kind=dpo",
        ):
            resume_point(cfg.trainer, {"actor": cfg.model.path})
    finally:
        checkpointing.check_resume = original


def test_token_rows_put_each_response_token_at_its_predicting_position():
    rows = token_rows([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], [[1, 1], [1, 0, 1]], 0, "cpu")
    assert rows.input_ids.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 0]]
    assert rows.seq_lens.tolist() == [5, 4]
    pos = rows.positions()
    targets = rows.input_ids.gather(1, (pos + 1).clamp(max=4))
    assert targets[0, :2].tolist() == [1, 2] and targets[1].tolist() == [3, 4, 9]
    assert rows.loss_mask.tolist() == [[1, 1, 0], [1, 0, 1]] and rows.tokens().tolist() == [2, 2]


def test_length_groups_by_count_and_by_token_budget():
    lens = [9, 3, 5, 7, 1]
    assert length_groups(lens, 2) == [[4, 1], [2, 3], [0]]
    assert length_groups(lens, 99, max_tokens=9, packed=True) == [[4, 1, 2], [3], [0]]
    assert length_groups(lens, 99, max_tokens=10, packed=False) == [[4, 1], [2], [3], [0]]


def test_token_accuracy_is_the_argmax_of_the_real_vocabulary():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 10, generator=gen)
    logits[..., 8:] = 100.0  # padding columns past the vocabulary never win
    targets = torch.randint(0, 8, (3, 4), generator=gen)
    targets[0, 0] = logits[0, 0, :8].argmax()
    got = vocab_parallel_is_argmax(logits, targets, None, vocab_size=8)
    assert got.tolist() == (logits[..., :8].argmax(-1) == targets).tolist()
    assert bool(got[0, 0])
