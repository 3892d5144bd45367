"""A data position saved at one data-parallel size resumes at another: the rest of the epoch
brings the global batches the old layout would have brought, then the new layout's own plan."""

from __future__ import annotations

from typing import Any

import pytest

from megarl.data import DataError, PromptDataset
from megarl.data.global_state import merge_rank_states
from tests.unit.test_data_files import tiny_tokenizer, write_prompt_files

pytestmark = pytest.mark.unit

LAYOUT = [(37, 10), (23, 7), (41, 16), (9, 9)]  # 110 rows
GLOBAL_BATCH = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("prompts")
    write_prompt_files(folder, LAYOUT)
    return str(folder / "part-*.parquet")


def make(files: str, rank: int, dp: int, **kw: Any) -> PromptDataset:
    return PromptDataset(
        files,
        tiny_tokenizer(),
        dp_rank=rank,
        dp_size=dp,
        batch_size_per_rank=GLOBAL_BATCH // dp,
        max_prompt_length=64,
        seed=5,
        window_rows=16,
        **kw,
    )


def global_batches(ranks: list[PromptDataset], steps: int) -> list[list[int]]:
    """``steps`` global batches (uids, DP ranks in order), as the trainer draws them."""
    iters = [iter(ds) for ds in ranks]
    out = []
    for _ in range(steps):
        batch = []
        for i, ds in enumerate(ranks):
            try:
                items = next(iters[i])
            except StopIteration:
                iters[i] = iter(ds)
                items = next(iters[i])
            batch += [it.uid for it in items]
        out.append(batch)
    return out


@pytest.mark.parametrize(("old_dp", "new_dp"), [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_mid_epoch_resume_at_another_dp_size_keeps_the_global_batches(files, old_dp, new_dp):
    old = [make(files, r, old_dp) for r in range(old_dp)]
    steps_per_epoch = old[0].steps_per_epoch
    done = 5
    global_batches(old, done)
    saved = merge_rank_states([ds.state_dict() for ds in old])
    expected = global_batches(old, steps_per_epoch - done)  # the rest of the old epoch

    new = [make(files, r, new_dp) for r in range(new_dp)]
    for ds in new:
        ds.load_state_dict(saved)
    assert global_batches(new, steps_per_epoch - done) == expected
    # a checkpoint in the middle of the resumed epoch is again a global record of the old layout
    # (tested above by construction); afterwards the new layout plans its own epochs
    assert all(ds.epoch == 1 for ds in new)
    fresh = [make(files, r, new_dp) for r in range(new_dp)]
    skip = global_batches(fresh, fresh[0].steps_per_epoch)
    assert len(skip) == fresh[0].steps_per_epoch
    assert global_batches(new, 3) == global_batches(fresh, 3)


def test_a_save_inside_the_resumed_epoch_resumes_again(files):
    old = [make(files, 0, 1)]
    global_batches(old, 3)
    saved = merge_rank_states([ds.state_dict() for ds in old])
    expected = global_batches(old, 4)
    new = [make(files, r, 2) for r in range(2)]
    for ds in new:
        ds.load_state_dict(saved)
    assert global_batches(new, 2) == expected[:2]
    again = merge_rank_states([ds.state_dict() for ds in new])
    assert again["dp_size"] == 1  # still the old layout's epoch
    back = [make(files, 0, 1)]
    back[0].load_state_dict(again)
    assert global_batches(back, 2) == expected[2:]


def test_another_global_batch_size_is_refused(files):
    old = [make(files, 0, 1)]
    global_batches(old, 2)
    saved = merge_rank_states([ds.state_dict() for ds in old])
    other = PromptDataset(
        files,
        tiny_tokenizer(),
        dp_rank=0,
        dp_size=2,
        batch_size_per_rank=4,
        max_prompt_length=64,
        seed=5,
        window_rows=16,
    )
    with pytest.raises(DataError, match="same global batch size"):
        other.load_state_dict(saved)
