"""The registered DPO losses against their papers' formulas written out here, the registry seam
(inputs by signature, reference or not), and the config checks of dpo.* before any process."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algos.choices import resolve_dpo_loss
from megarl.algos.dpo import DPO_LOSSES, dpo_loss, loss_inputs, needs_reference
from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.run.checks import check_choices


def _inputs(seed: int = 0, pairs: int = 6) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logps = lambda: -10.0 * torch.rand(pairs, generator=gen, dtype=torch.float64)  # noqa: E731
    tokens = torch.randint(1, 12, (pairs,), generator=gen).double()
    return {
        "chosen_logps": logps(),
        "rejected_logps": logps(),
        "ref_chosen_logps": logps(),
        "ref_rejected_logps": logps(),
        "chosen_tokens": tokens,
        "rejected_tokens": tokens.flip(0),
    }


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def _expected(name: str, i: dict[str, float], beta: float, **kw) -> float:
    """One pair's loss as the papers write it, in plain Python floats."""
    c = i["chosen_logps"] - i["ref_chosen_logps"]
    r = i["rejected_logps"] - i["ref_rejected_logps"]
    nc, nr = i["chosen_tokens"], i["rejected_tokens"]
    if name == "sigmoid":  # Rafailov et al. 2023, eq. 7
        return -_log_sigmoid(beta * (c - r))
    if name == "hinge":  # SLiC-HF
        return max(0.0, 1.0 - beta * (c - r))
    if name == "ipo":  # Azar et al. 2023, eq. 17 on per-token means
        return (c / nc - r / nr - 1.0 / (2.0 * beta)) ** 2
    if name == "robust":  # Chowdhury et al. 2024, eq. 8
        e = kw["label_smoothing"]
        z = beta * (c - r)
        return ((1 - e) * -_log_sigmoid(z) - e * -_log_sigmoid(-z)) / (1 - 2 * e)
    if name == "sigmoid_norm":
        return -_log_sigmoid(beta * (c / nc - r / nr))
    if name == "simpo":  # Meng et al. 2024, eq. 6
        gamma = kw["gamma"]
        margin = beta * i["chosen_logps"] / nc - beta * i["rejected_logps"] / nr - gamma
        return -_log_sigmoid(margin)
    raise AssertionError(name)


CASES = [
    ("sigmoid", 0.1, {}),
    ("hinge", 0.5, {}),
    ("ipo", 0.2, {}),
    ("robust", 0.3, {"label_smoothing": 0.15}),
    ("sigmoid_norm", 0.7, {}),
    ("simpo", 2.0, {"gamma": 0.4}),
]


@pytest.mark.parametrize(("name", "beta", "kw"), CASES)
def test_each_loss_equals_its_formula_and_reports_its_rewards(name, beta, kw):
    inputs = _inputs(seed=len(name))
    losses, mean, metrics = dpo_loss(name, inputs, beta=beta, **kw)
    rows = [{k: float(v[p]) for k, v in inputs.items()} for p in range(6)]
    expected = [_expected(name, row, beta, **kw) for row in rows]
    assert losses.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert float(mean) == pytest.approx(sum(expected) / 6, rel=1e-12)
    if needs_reference(DPO_LOSSES.get(name)):
        chosen = beta * (inputs["chosen_logps"] - inputs["ref_chosen_logps"])
        rejected = beta * (inputs["rejected_logps"] - inputs["ref_rejected_logps"])
    else:
        chosen = beta * inputs["chosen_logps"] / inputs["chosen_tokens"]
        rejected = beta * inputs["rejected_logps"] / inputs["rejected_tokens"]
    assert float(metrics["reward_accuracy"]) == pytest.approx(
        float((chosen > rejected).double().mean())
    )
    assert float(metrics["reward_margin"]) == pytest.approx(float((chosen - rejected).mean()))
    assert float(metrics["chosen_logp"]) == pytest.approx(float(inputs["chosen_logps"].mean()))


def test_the_gradient_of_dpo_raises_chosen_and_lowers_rejected():
    inputs = {
        k: v.clone().requires_grad_(k in ("chosen_logps", "rejected_logps"))
        for k, v in _inputs().items()
    }
    _, loss, _ = dpo_loss("sigmoid", inputs, beta=0.1)
    loss.backward()
    assert (inputs["chosen_logps"].grad < 0).all() and (inputs["rejected_logps"].grad > 0).all()


def test_inputs_come_from_the_signature_and_decide_the_reference():
    assert loss_inputs(DPO_LOSSES.get("sigmoid")) == (
        "chosen_logps",
        "rejected_logps",
        "ref_chosen_logps",
        "ref_rejected_logps",
    )
    assert needs_reference(DPO_LOSSES.get("ipo")) and not needs_reference(DPO_LOSSES.get("simpo"))
    # a reference-free loss is never handed the reference
    inputs = _inputs()
    del inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
    dpo_loss("simpo", inputs, beta=2.0)
    with pytest.raises(ValueError, match="needs"):
        dpo_loss("sigmoid", inputs, beta=0.1)


def _cfg(tmp_path, *overrides: str):
    """The config as the CLI takes it: loaded, then its registry words checked."""
    cfg = load_config(
        None,
        [
            "trainer.kind=dpo",
            f"model.path={tmp_path}",
            f"data.train_files=[{tmp_path}/x.parquet]",
            *overrides,
        ],
    )
    check_choices(cfg)
    return cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["dpo.loss=dpoo"],
            "dpo.loss='dpoo' is not a registered DPO loss; known: hinge, ipo, robust",
        ),
        (["dpo.beta=0"], "beta must be > 0"),
        (
            ["dpo.loss=robust", "dpo.loss_kwargs={label_smoothing: 0.7}"],
            r"label_smoothing must be in \[0, 0.5\)",
        ),
        (
            ["dpo.loss_kwargs={gamma: 1.0}"],
            "dpo.loss_kwargs has 'gamma', which dpo.loss='sigmoid' does not take",
        ),
        (["dpo.loss=simpo", "dpo.reference_path=/ref"], "dpo.loss='simpo' is reference-free"),
        (["dpo.truncation=left"], "dpo.truncation='left' is not one of"),
        (["dpo.micro_batch_size=0"], "dpo.micro_batch_size must be >= 1"),
    ],
)
def test_bad_dpo_settings_fail_at_load_naming_the_fix(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, *overrides)


def test_simpo_takes_its_own_beta_and_gamma(tmp_path):
    cfg = _cfg(tmp_path, "dpo.loss=simpo", "dpo.beta=2.5", "dpo.loss_kwargs={gamma: 0.3}")
    loss = resolve_dpo_loss(cfg.dpo)
    assert loss.kwargs == {"beta": 2.5, "gamma": 0.3}
    assert not loss.needs_reference
