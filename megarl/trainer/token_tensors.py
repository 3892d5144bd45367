"""The per-token tensors a step's samples carry between its phases (``Samples.tensors``).

Each is ``[samples, max_response_len]`` in response space (:mod:`megarl.trainer.batch`), one field
of :class:`TokenTensors`, and None until the phase that fills it has run. A phase that needs one
reads it with :meth:`TokenTensors.require`, which names the phase that fills it when it is still
absent; a field that may rightly be absent (``rollout_is_weights`` without a rollout correction,
``values`` without a critic) is read directly and checked for None. What the step does to rows
(select and trim, concatenate, move to a device, list the present ones for the DP exchange or
the dump) is written once over the fields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

import torch

# The names of TokenTensors' fields (a unit test holds the two to the same names): what
# ``require``, ``put`` and model_ops.ppo_update's ``keep`` take.
TokenField = Literal[
    "rollout_log_prob",
    "token_level_scores",
    "old_log_prob",
    "ref_log_prob",
    "teacher_log_prob",
    "values",
    "token_level_rewards",
    "advantages",
    "returns",
    "rollout_is_weights",
]
TOKEN_FIELDS: tuple[TokenField, ...] = get_args(TokenField)


class MissingTokenTensor(RuntimeError):
    """A phase read a per-token tensor before the phase that fills it ran: the step's phases are
    out of order, or the setting that turns the filling phase on is off."""


def _filled_by(phase: str) -> dict[str, str]:
    """A field's metadata: the phase that fills it (the error of an early read names it)."""
    return {"filled_by": phase}


@dataclass
class TokenTensors:
    """The per-token tensors of a step's samples, each filled by one phase of the step."""

    rollout_log_prob: torch.Tensor | None = field(
        default=None,
        metadata=_filled_by("the rollout's samples (trainer.experience.rollout_samples)"),
    )
    """The rollout engine's logprob of each sampled token."""

    token_level_scores: torch.Tensor | None = field(
        default=None,
        metadata=_filled_by(
            "the reward phase (trainer.experience.set_outcome_scores / set_trajectory_scores)"
        ),
    )
    """The outcome score on each sample's last response token (and a multi-turn trajectory's turn
    rewards on their turns' last tokens), before any KL penalty."""

    old_log_prob: torch.Tensor | None = field(
        default=None,
        metadata=_filled_by(
            "the actor's scoring pass (trainer.old_log_probs.score_old_log_probs) or, when the batch "
            "gets one optimizer step, the actor's update (trainer.model_ops.ppo_update keeps its own "
            "logprobs)"
        ),
    )
    """The actor's logprobs before the update: those of the PPO ratio's denominator."""

    ref_log_prob: torch.Tensor | None = field(
        default=None,
        metadata=_filled_by(
            "the reference pass of trainer.experience.compute_experience (run with a reference "
            "model: algorithm.use_kl_loss or algorithm.use_kl_in_reward)"
        ),
    )
    """The reference model's logprobs, for the KL terms."""

    teacher_log_prob: torch.Tensor | None = field(
        default=None,
        metadata=_filled_by(
            "the teacher pass (trainer.distill.distill_experience, with algorithm.distill.teacher_path)"
        ),
    )
    """The frozen teacher's logprobs (on-policy distillation)."""

    values: torch.Tensor | None = field(
        default=None,
        metadata=_filled_by(
            "the critic pass of trainer.experience.compute_experience (with a critic)"
        ),
    )
    """The critic's value of each response token before its update."""

    token_level_rewards: torch.Tensor | None = field(
        default=None, metadata=_filled_by("trainer.experience.compute_experience")
    )
    """The token scores less the KL penalty when ``algorithm.use_kl_in_reward`` (else the scores)."""

    advantages: torch.Tensor | None = field(
        default=None,
        metadata=_filled_by("the advantage estimator in trainer.experience.compute_experience"),
    )
    """The estimator's advantages (``algorithm.distill.mode=reward`` adds its reverse-KL term)."""

    returns: torch.Tensor | None = field(
        default=None,
        metadata=_filled_by("the advantage estimator in trainer.experience.compute_experience"),
    )
    """The estimator's returns: the critic's targets."""

    rollout_is_weights: torch.Tensor | None = field(
        default=None,
        metadata=_filled_by(
            "trainer.experience.compute_experience with algorithm.rollout_correction"
        ),
    )
    """The importance weights of ``algorithm.rollout_correction`` (None: no weights)."""

    def require(self, name: TokenField) -> torch.Tensor:
        """The tensor ``name``; raises :class:`MissingTokenTensor` naming the phase that fills it
        when that phase has not run."""
        value = getattr(self, _checked(name))
        if value is None:
            raise MissingTokenTensor(
                f"samples.tensors.{name} is read before it is filled: {_phase(name)} fills it. "
                "Run that phase before the one reading it, or turn on the setting it needs"
            )
        return value

    def put(self, name: TokenField, value: torch.Tensor) -> None:
        """Set the tensor ``name`` when the name comes as data (e.g. ppo_update's ``keep``)."""
        setattr(self, _checked(name), value)

    def present(self) -> dict[TokenField, torch.Tensor]:
        """The filled tensors by name, in field order."""
        out: dict[TokenField, torch.Tensor] = {}
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TokenTensors:
        """``fn`` of every filled tensor; the absent ones stay absent."""
        return TokenTensors(**{name: fn(value) for name, value in self.present().items()})

    def select(self, rows: torch.Tensor, width: int) -> TokenTensors:
        """The samples ``rows`` (an index tensor on the tensors' device), trimmed to ``width``
        response tokens."""
        return self.map(lambda value: value[rows, :width])

    def to(self, device: torch.device | str) -> TokenTensors:
        return self.map(lambda value: value.to(device))

    @classmethod
    def concat(cls, pieces: Sequence[TokenTensors], width: int) -> TokenTensors:
        """The rows of ``pieces`` in one record, each tensor right padded with 0 to ``width``
        response tokens. Every piece must hold the same tensors."""
        if not pieces:
            return cls()
        names = list(pieces[0].present())
        for k, piece in enumerate(pieces[1:], start=1):
            if list(piece.present()) != names:
                raise ValueError(
                    f"cannot concatenate samples holding different per-token tensors: piece 0 "
                    f"holds {names}, piece {k} {list(piece.present())}"
                )
        return cls(
            **{name: torch.cat([_padded(p.require(name), width) for p in pieces]) for name in names}
        )


def _padded(value: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(value, (0, width - value.shape[1]), value=0.0)


_FIELDS = {f.name: f for f in fields(TokenTensors)}


def _checked(name: str) -> str:
    """``name`` if TokenTensors has such a field (a name that came as data is checked here)."""
    if name not in _FIELDS:
        raise ValueError(f"no per-token tensor {name!r}; TokenTensors holds {list(_FIELDS)}")
    return name


def _phase(name: str) -> str:
    return str(_FIELDS[name].metadata["filled_by"])
