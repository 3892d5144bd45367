"""What a user meets before any process starts: protected output folders, metrics cut back on
resume, verl's habits on the command line and in configs (options anywhere, a path for a list,
verl's keys answered with megarl's), import paths and reward columns checked up front, and the
error of a run whose scores mostly fail."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.cli import parse
from megarl.config import RunConfig, load_config
from megarl.config_keys import all_keys
from megarl.errors import ConfigError, MegarlError
from megarl.rewards.failures import describe_first, failed_scores_error, too_many_failed
from megarl.rewards.manager import RewardManager, RewardSample
from megarl.run.checks import check_import_settings, check_reward_columns
from megarl.run.output_dir import check_output_dir, move_aside
from megarl.run.tracking import cut_metrics
from megarl.verl_keys import VERL_KEYS

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
BASE = ["model.path=/m", "data.train_files=[/d.parquet]"]


def run_folder(tmp_path: Path, *, checkpoint: bool, metrics: bool) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    if checkpoint:
        (out / "checkpoints" / "step_00000004").mkdir(parents=True)
        (out / "checkpoints" / "latest").write_text("step_00000004\n")
    if metrics:
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
    return out


def cfg_for(out: Path, *extra: str) -> RunConfig:
    return load_config(None, [*BASE, f"trainer.output_dir={out}", *extra])


def test_a_fresh_run_over_an_earlier_one_is_refused_naming_both_ways_on(tmp_path):
    out = run_folder(tmp_path, checkpoint=True, metrics=True)
    with pytest.raises(ConfigError) as e:
        check_output_dir(cfg_for(out, "trainer.resume=never").trainer)
    message = str(e.value)
    assert str(out) in message and "checkpoints (step 4)" in message
    assert "trainer.resume=auto" in message and "trainer.overwrite=true" in message
    assert check_output_dir(cfg_for(out).trainer) is False  # auto: it resumes
    assert check_output_dir(cfg_for(out, "trainer.resume=never", "trainer.overwrite=true").trainer)
    assert check_output_dir(cfg_for(tmp_path / "new", "trainer.resume=never").trainer) is False


def test_metrics_without_a_checkpoint_are_protected_too(tmp_path):
    out = run_folder(tmp_path, checkpoint=False, metrics=True)
    with pytest.raises(ConfigError, match=r"no checkpoint to continue from.*overwrite=true"):
        check_output_dir(cfg_for(out).trainer)


def test_overwrite_moves_the_earlier_run_aside_and_deletes_nothing(tmp_path):
    out = run_folder(tmp_path, checkpoint=True, metrics=True)
    aside = move_aside(out)
    assert not out.exists()
    assert re.fullmatch(r"run\.old-\d{8}-\d{6}", aside.name)
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (aside / "checkpoints" / "step_00000004").is_dir()


def test_metrics_are_cut_back_to_the_checkpoint_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "reward/mean": s / 10} for s in (0, 1, 2, 3, 4, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 6, "rew')
    assert cut_metrics(path, 4) == 2  # step 5 and the line a crash cut off
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3, 4]
    assert cut_metrics(path, 4) == 0 and cut_metrics(path, 0) == 0


def test_an_elastic_restart_writes_into_its_own_jobs_folder(tmp_path, monkeypatch):
    """The failed attempt's metrics (no checkpoint yet, trainer.resume=never) are the job's own:
    the restarted ranks do not refuse the folder as an earlier run's, and start it again."""
    from megarl.run.elastic import ENV, AttemptRecord
    from megarl.run.output_dir import prepare_output_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = cfg_for(out, "trainer.resume=never")
    monkeypatch.setenv(ENV, AttemptRecord(1, 2, 2, 1, 1).to_env()[ENV])
    prepare_output_dir(cfg.trainer, rank=0)  # no process group needed: nothing to move
    # a restart from the start (no checkpoint yet) logs every step again: each step once
    assert (out / "metrics.jsonl").read_text() == ""
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    monkeypatch.setenv(ENV, AttemptRecord(0, 4, 2, 1, 2).to_env()[ENV])  # the first attempt
    with pytest.raises(ConfigError, match="holds an earlier run"):
        prepare_output_dir(cfg.trainer, rank=0)


def test_options_and_overrides_anywhere_on_the_command_line():
    args = parse(
        ["train", "run.yaml", "--nproc-per-node", "2", "rollout.sampling.n=2", "data.seed=3"]
    )
    assert args.nproc_per_node == 2 and args.overrides == ["rollout.sampling.n=2", "data.seed=3"]
    args = parse(["train-rm", "rm.yaml", "a.b=1", "--verbose", "c.d=2"])
    assert args.verbose and args.overrides == ["a.b=1", "c.d=2"]
    with pytest.raises(SystemExit):
        parse(["train", "run.yaml", "--bogus"])


def test_a_single_path_is_a_one_element_list_and_hydra_plus_is_accepted(tmp_path):
    cfg = load_config(
        None, ["model.path=/m", "data.train_files=/x.parquet", "+rollout.sampling.n=3"]
    )
    assert cfg.data.train_files == ["/x.parquet"] and cfg.rollout.sampling.n == 3
    yaml = tmp_path / "run.yaml"
    yaml.write_text(
        "model:\n  path: /m\ndata:\n  train_files: /y.parquet\ntrainer:\n  loggers: console\n"
    )
    cfg = load_config(yaml)
    assert cfg.data.train_files == ["/y.parquet"] and cfg.trainer.loggers == ["console"]


@pytest.mark.parametrize(
    ("key", "answer"),
    [
        ("custom_reward_function.path=/r.py", "did you mean reward.custom_fn"),
        ("data.max_response_length=512", "did you mean rollout.sampling.max_response_length"),
        ("trainer.total_training_steps=10", "did you mean trainer.total_steps"),
        ("actor_rollout_ref.actor.optim.lr=1e-6", "did you mean actor.optim.lr"),
        ("actor_rollout_ref.rollout.n=5", "did you mean rollout.sampling.n"),
        ("actor_rollout_ref.hybrid_engine=true", "megarl splits into model.*, actor.*"),
        ("algorithm.kl_ctrl.kl_coef=0.1", "did you mean algorithm.kl_coef"),
        ("reward_model.model.path=/rm", "did you mean reward.model_path"),
        ("trainer.n_gpus_per_node=8", "--nproc-per-node"),
    ],
)
def test_verl_keys_get_megarls(key, answer):
    with pytest.raises(ConfigError, match=r"unknown setting '") as e:
        load_config(None, [*BASE, key])
    assert answer in str(e.value)


def test_a_verl_config_file_names_every_unknown_key_in_full(tmp_path):
    yaml = tmp_path / "verl.yaml"
    yaml.write_text(
        "model:\n  path: /m\ndata:\n  train_files: [/d.parquet]\n  max_response_length: 64\n"
        "actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 8\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(yaml)
    message = str(e.value)
    assert "2 unknown settings" in message and str(yaml) in message
    assert "\n  'data.max_response_length' is verl's name" in message
    assert (
        "'actor_rollout_ref.actor.ppo_mini_batch_size' is verl's name; did you mean actor.ppo_mini_batch_size"
        in message
    )


def test_every_unknown_key_is_named_at_once_each_with_its_suggestion(tmp_path):
    # a verl config brings many unknown keys: one round names them all (once five, "and N more")
    verl = {
        "trainer.total_training_steps": "did you mean trainer.total_steps",
        "trainer.project_name": "did you mean trainer.experiment",
        "trainer.experiment_name": "did you mean trainer.run_name",
        "trainer.logger": "did you mean trainer.loggers",
        "trainer.default_local_dir": "did you mean trainer.output_dir",
        "trainer.n_gpus_per_node": "--nproc-per-node",
        "data.max_response_length": "did you mean rollout.sampling.max_response_length",
        "algorithm.kl_ctrl.kl_coef": "did you mean algorithm.kl_coef",
        "actor_rollout_ref.rollout.n": "did you mean rollout.sampling.n",
        "actor_rollout_ref.actor.optim.lr": "did you mean actor.optim.lr",
        "reward_model.model.path": "did you mean reward.model_path",
        "actor.optim.lrr": "did you mean actor.optim.lr",
    }
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, *(f"{k}=1" for k in verl)])
    message = str(e.value)
    assert message.startswith(f"{len(verl)} unknown settings") and "more)" not in message
    lines = message.splitlines()[1:]
    assert len(lines) == len(verl)
    for key, answer in verl.items():
        [line] = [ln for ln in lines if ln.startswith(f"  {key!r}")]
        assert answer in line, line


def test_the_verl_table_names_real_keys_only_and_docs_hold_the_same_table():
    real = set(all_keys(RunConfig))
    named = {v.megarl for v in VERL_KEYS.values() if v.megarl is not None}
    assert named <= real, sorted(named - real)
    assert not set(VERL_KEYS) & real  # a key both spell alike needs no entry
    for note in (v.note for v in VERL_KEYS.values()):  # keys a note names are real too
        for key in re.findall(r"\b[a-z_]+\.[a-z_]+(?:\.[a-z_]+)*\b", note):
            assert key in real or key.endswith(".py"), (key, note)
    rows = re.findall(
        r"^\| `([^`]+)` \| (.*?) \| (.*?) \|$", (REPO / "docs" / "verl_keys.md").read_text(), re.M
    )
    documented = {k: (m.strip("`") if m != "-" else None, n) for k, m, n in rows}
    assert documented == {k: (v.megarl, v.note) for k, v in VERL_KEYS.items()}


def test_import_paths_are_imported_and_their_signature_checked(tmp_path):
    def check(spec: str) -> None:
        check_import_settings(cfg_for(tmp_path / "out", f"reward.custom_fn={spec}"))

    check("megarl.rewards.toy:vowel_rate")
    with pytest.raises(
        ConfigError, match=r"reward.custom_fn='megarl.rewards.toy:nope'.*no attribute"
    ):
        check("megarl.rewards.toy:nope")
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_module'"):
        check("no_such_module:fn")
    scorer = tmp_path / "score.py"
    scorer.write_text("def score(solution_str):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"cannot be called as score\(data_source=\.\.\."):
        check(f"{scorer}:score")


def prompts(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_missing_reward_columns_and_unscored_sources_are_found_before_launch(tmp_path):
    from megarl.data.parquet_source import inspect_files, resolve_files

    no_truth = prompts(tmp_path / "a.parquet", [{"prompt": "q", "data_source": "openai/gsm8k"}])
    other = prompts(
        tmp_path / "b.parquet",
        [{"prompt": "q", "data_source": "my/task", "reward_model": {"ground_truth": "1"}}],
    )

    def check(path: Path, *extra: str) -> None:
        cfg = load_config(None, ["model.path=/m", f"data.train_files=[{path}]", *extra])
        fs, paths = resolve_files(cfg.data.train_files)
        check_reward_columns(
            cfg.trainer.kind, cfg.reward, inspect_files(fs, paths), fs, "data.train_files"
        )

    with pytest.raises(MegarlError, match=r"a.parquet: missing column 'reward_model'.*custom_fn"):
        check(no_truth)
    with pytest.raises(ConfigError, match=r"data_source \['my/task'\], which no built-in scorer"):
        check(other)
    check(no_truth, "reward.custom_fn=megarl.rewards.toy:vowel_rate")  # it may do without


def test_a_mostly_failing_reward_names_the_scorer_its_error_and_a_sample():
    manager = RewardManager(custom_fn="megarl.rewards.toy:vowel_rate")
    samples = [RewardSample("openai/gsm8k", "aaa", "7")] * 2
    manager.custom_fn = lambda **kw: float("nan")  # what a broken scorer returns
    result = manager.score(samples)
    assert len(result.failures) == 2
    first = describe_first(manager, samples, result)
    assert "scorer returned nan" in first and "'aaa'" in first and "'7'" in first
    assert too_many_failed(2, 2, 0.5) and not too_many_failed(1, 2, 0.5)
    message = str(failed_scores_error(2, 2, 0.5, first))
    assert "2 of 2 samples (100%) failed to score" in message
    assert "reward.max_failed_fraction=0.5" in message and "last checkpoint is kept" in message
