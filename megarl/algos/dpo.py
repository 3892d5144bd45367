"""DPO and its variants: per-pair losses over sequence logprobs, registered by name (``dpo.loss``).

A loss takes, by name and positionally, the inputs it uses of:

- ``chosen_logps``, ``rejected_logps``: ``[P]`` the policy's summed logprobs of each pair's
  chosen and rejected response tokens;
- ``ref_chosen_logps``, ``ref_rejected_logps``: the same under the frozen reference policy (a
  loss that takes them needs a reference model; one that does not is reference-free);
- ``chosen_tokens``, ``rejected_tokens``: ``[P]`` the responses' token counts (length-normalised
  variants);

and its hyperparameters as keyword-only arguments (``beta`` from ``dpo.beta``, the rest from
``dpo.loss_kwargs``). It returns ``(losses [P], chosen_rewards [P], rejected_rewards [P])``: the
per-pair loss and the implicit rewards that the reward accuracy and margin metrics read
(``beta * (logp - ref_logp)`` for the reference-based losses, as in the DPO paper).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from megarl.algos.registry import Registry

DPO_LOSSES: Registry = Registry("DPO loss")
register_dpo_loss = DPO_LOSSES.register

DPOResult = tuple[Tensor, Tensor, Tensor]
INPUTS = (
    "chosen_logps",
    "rejected_logps",
    "ref_chosen_logps",
    "ref_rejected_logps",
    "chosen_tokens",
    "rejected_tokens",
)


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")


def _logratios(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
) -> tuple[Tensor, Tensor]:
    return chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps


@register_dpo_loss("sigmoid")
def sigmoid(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
) -> DPOResult:
    """DPO (Rafailov et al. 2023): ``-log sigmoid(beta * (chosen - rejected log-ratio))``."""
    _check_beta(beta)
    c, r = _logratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return -F.logsigmoid(beta * (c - r)), beta * c, beta * r


@register_dpo_loss("hinge")
def hinge(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
) -> DPOResult:
    """SLiC's hinge on the log-ratio margin: ``relu(1 - beta * (chosen - rejected))``."""
    _check_beta(beta)
    c, r = _logratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return torch.relu(1.0 - beta * (c - r)), beta * c, beta * r


@register_dpo_loss("ipo")
def ipo(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    *,
    beta: float = 0.1,
) -> DPOResult:
    """IPO (Azar et al. 2023): ``(h - 1 / (2 beta))^2`` with ``h`` the difference of the per-token
    mean log-ratios (``beta`` is the paper's tau); the length normalisation keeps ``beta``
    comparable across response lengths."""
    _check_beta(beta)
    c, r = _logratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    h = c / chosen_tokens.clamp(min=1) - r / rejected_tokens.clamp(min=1)
    return (h - 1.0 / (2.0 * beta)).square(), beta * c, beta * r


@register_dpo_loss("robust")
def robust(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> DPOResult:
    """Robust DPO (Chowdhury et al. 2024): unbiased under preference labels flipped with
    probability ``label_smoothing`` (0: plain DPO)."""
    _check_beta(beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    c, r = _logratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    z = beta * (c - r)
    eps = label_smoothing
    losses = (-(1.0 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)
    return losses, beta * c, beta * r


@register_dpo_loss("sigmoid_norm")
def sigmoid_norm(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    *,
    beta: float = 0.1,
) -> DPOResult:
    """Length-normalised DPO: the sigmoid loss on per-token mean log-ratios."""
    _check_beta(beta)
    c, r = _logratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    delta = c / chosen_tokens.clamp(min=1) - r / rejected_tokens.clamp(min=1)
    return -F.logsigmoid(beta * delta), beta * c, beta * r


@register_dpo_loss("simpo")
def simpo(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
) -> DPOResult:
    """SimPO (Meng et al. 2024), reference-free: ``-log sigmoid(beta * (mean chosen logp - mean
    rejected logp) - gamma)``; its rewards are ``beta`` x the per-token mean logprobs."""
    _check_beta(beta)
    c = beta * chosen_logps / chosen_tokens.clamp(min=1)
    r = beta * rejected_logps / rejected_tokens.clamp(min=1)
    return -F.logsigmoid(c - r - gamma), c, r


def loss_inputs(fn: Callable[..., object]) -> tuple[str, ...]:
    """The inputs (of :data:`INPUTS`) a DPO loss takes, in its signature's order."""
    params = inspect.signature(fn).parameters.values()
    names = tuple(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )
    unknown = [n for n in names if n not in INPUTS]
    if unknown:
        raise TypeError(
            f"DPO loss {fn.__qualname__} takes {unknown}, which are not DPO inputs {list(INPUTS)}"
        )
    return names


def needs_reference(fn: Callable[..., object]) -> bool:
    """Whether a DPO loss compares against a reference policy (takes its logprobs)."""
    inputs = loss_inputs(fn)
    return "ref_chosen_logps" in inputs or "ref_rejected_logps" in inputs


def dpo_loss(
    name: str, inputs: Mapping[str, Tensor], **kwargs: object
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The named loss's per-pair losses ``[P]``, its pair-mean, and the pair-mean metrics:
    ``loss``, ``reward_accuracy`` (share of pairs whose chosen reward is the higher),
    ``reward_margin``, ``chosen_reward``, ``rejected_reward``, ``chosen_logp``, ``rejected_logp``."""
    fn = DPO_LOSSES.get(name)
    names = loss_inputs(fn)
    missing = [n for n in names if n not in inputs]
    if missing:
        raise ValueError(f"DPO loss {name!r} needs {missing}")
    losses, chosen_rewards, rejected_rewards = DPO_LOSSES.call(
        name, *(inputs[n] for n in names), **kwargs
    )
    c, r = chosen_rewards.detach(), rejected_rewards.detach()
    metrics = {
        "loss": losses.detach().mean(),
        "reward_accuracy": (c > r).float().mean(),
        "reward_margin": (c - r).mean(),
        "chosen_reward": c.mean(),
        "rejected_reward": r.mean(),
        "chosen_logp": inputs["chosen_logps"].detach().mean(),
        "rejected_logp": inputs["rejected_logps"].detach().mean(),
    }
    return losses, losses.mean(), metrics


def try_dpo_loss(name: str, kwargs: Mapping[str, object]) -> None:
    """Call the named loss once on two made-up pairs, so a value it refuses fails before launch."""
    logps = torch.tensor([-3.0, -4.0])
    tokens = torch.tensor([2.0, 3.0])
    inputs = dict.fromkeys(("chosen_logps", "rejected_logps"), logps)
    inputs.update(dict.fromkeys(("ref_chosen_logps", "ref_rejected_logps"), logps - 0.5))
    inputs.update(dict.fromkeys(("chosen_tokens", "rejected_tokens"), tokens))
    dpo_loss(name, inputs, **kwargs)
