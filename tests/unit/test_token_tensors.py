"""The per-token tensors between a step's phases (``Samples.tensors``): one field per quantity,
an early read that names the phase filling it, and the row operations written once over the
fields (select and trim, concatenate, move, list the present ones)."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from megarl.trainer.batch import Samples
from megarl.trainer.dp_balance import host_rows, samples_of_rows
from megarl.trainer.token_tensors import TOKEN_FIELDS, MissingTokenTensor, TokenTensors

pytestmark = pytest.mark.unit


def _record() -> TokenTensors:
    """Three samples, response width 4, with two of the ten tensors filled."""
    old = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return TokenTensors(old_log_prob=old, advantages=-old)


def test_the_names_a_phase_reads_by_are_the_fields_and_each_field_names_its_phase():
    assert tuple(f.name for f in fields(TokenTensors)) == TOKEN_FIELDS
    for f in fields(TokenTensors):
        assert f.default is None, f.name
        assert len(f.metadata["filled_by"]) > 10, f.name


def test_reading_a_tensor_no_phase_has_filled_names_the_phase_that_fills_it():
    t = _record()
    assert torch.equal(t.require("advantages"), -t.require("old_log_prob"))
    with pytest.raises(MissingTokenTensor, match=r"tensors\.ref_log_prob .*compute_experience"):
        t.require("ref_log_prob")
    with pytest.raises(MissingTokenTensor, match=r"score_old_log_probs.*ppo_update"):
        TokenTensors().require("old_log_prob")
    assert not issubclass(MissingTokenTensor, KeyError)


def test_a_name_that_comes_as_data_is_checked_against_the_fields():
    t = TokenTensors()
    t.put("values", torch.ones(2, 3))
    assert torch.equal(t.require("values"), torch.ones(2, 3))
    with pytest.raises(ValueError, match="no per-token tensor 'new_log_prob'"):
        t.put("new_log_prob", torch.ones(2, 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no per-token tensor"):
        t.require("entropy")  # type: ignore[arg-type]


def test_present_lists_the_filled_tensors_in_field_order():
    t = TokenTensors(returns=torch.zeros(1, 1), rollout_log_prob=torch.ones(1, 1))
    assert list(t.present()) == ["rollout_log_prob", "returns"]
    assert TokenTensors().present() == {}


def test_select_takes_the_rows_and_trims_every_present_tensor_to_the_width():
    t = _record()
    picked = t.select(torch.tensor([2, 0]), width=3)
    assert torch.equal(picked.require("old_log_prob"), torch.tensor([[8.0, 9, 10], [0, 1, 2]]))
    assert torch.equal(picked.require("advantages"), -torch.tensor([[8.0, 9, 10], [0, 1, 2]]))
    assert list(picked.present()) == ["old_log_prob", "advantages"]  # the absent stay absent
    assert picked.old_log_prob is not t.old_log_prob


def test_concat_pads_each_piece_with_zeros_to_the_width_in_row_order():
    a = TokenTensors(old_log_prob=torch.ones(1, 2), advantages=torch.full((1, 2), 2.0))
    b = TokenTensors(old_log_prob=torch.full((2, 3), 3.0), advantages=torch.full((2, 3), 4.0))
    both = TokenTensors.concat([a, b], width=4)
    assert torch.equal(
        both.require("old_log_prob"),
        torch.tensor([[1.0, 1, 0, 0], [3, 3, 3, 0], [3, 3, 3, 0]]),
    )
    assert torch.equal(
        both.require("advantages"),
        torch.tensor([[2.0, 2, 0, 0], [4, 4, 4, 0], [4, 4, 4, 0]]),
    )
    assert list(both.present()) == ["old_log_prob", "advantages"]
    assert TokenTensors.concat([], width=4).present() == {}


def test_concat_refuses_pieces_holding_different_tensors():
    a = TokenTensors(old_log_prob=torch.ones(1, 2))
    b = TokenTensors(old_log_prob=torch.ones(1, 2), advantages=torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"different per-token tensors.*piece 1"):
        TokenTensors.concat([a, b], width=2)


def test_to_moves_every_present_tensor_and_keeps_the_absent_ones_absent():
    moved = _record().to("meta")
    assert {name: v.device.type for name, v in moved.present().items()} == {
        "old_log_prob": "meta",
        "advantages": "meta",
    }
    assert moved.values is None and moved.rollout_is_weights is None


def _samples() -> Samples:
    s = Samples.from_sequences(
        [[1, 2], [3], [4, 5, 6]], [[7, 8, 9], [10], []], ["a", "a", "b"], pad_id=0, device="cpu"
    )
    s.tensors.old_log_prob = -torch.arange(9, dtype=torch.float32).reshape(3, 3) * s.response_mask
    s.tensors.token_level_scores = torch.tensor([[0, 0, 1.0], [0.5, 0, 0], [0, 0, 0]])
    return s


def test_samples_select_carries_the_tensors_of_its_rows_at_its_own_width():
    s = _samples()
    sub = s.select([1, 2])  # responses of 1 and 0 tokens: width 1
    assert torch.equal(sub.tensors.require("old_log_prob"), torch.tensor([[-3.0], [0.0]]))
    assert torch.equal(sub.tensors.require("token_level_scores"), torch.tensor([[0.5], [0.0]]))
    assert sub.tensors.advantages is None


def test_the_dp_exchange_rows_give_back_the_same_tensors():
    """dp_balance's host rows (what the all-gather moves) and back: the same samples, tensors and
    scores, in the order given."""
    s = _samples()
    rows = host_rows(s, torch.tensor([1.0, 0.5, 0.0]))
    back = samples_of_rows([rows[2], rows[0], rows[1]], pad_id=0, device=torch.device("cpu"))
    order = [2, 0, 1]
    for name, value in s.tensors.present().items():
        assert torch.equal(back.tensors.require(name), value[order]), name
    assert list(back.tensors.present()) == list(s.tensors.present())
