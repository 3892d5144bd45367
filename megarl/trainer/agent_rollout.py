"""``rollout.agent``'s part of a run: the agent, the endpoint's settings and limits from the
config (:func:`agent_source`); its trajectories are rewarded and trained like an environment's
(docs/agents.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.agents.loading import load_agent
from megarl.agents.runner import AgentLimits
from megarl.agents.trajectories import AgentSource
from megarl.agents.turns import TurnSettings
from megarl.config import RolloutConfig
from megarl.rollout.rollout_types import SamplingConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# the model name the endpoint serves: what an agent is given and must send
SERVED_MODEL = "policy"
# A step's agents all end within this share of trainer.hang_timeout_s (the watchdog's limit on a
# phase without progress, the rollout included): the rest is left for the engine's last calls and
# the move back to training, so agents queued behind slow ones score 0 instead of the run ending
# as a hung rank.
AGENTS_SHARE_OF_HANG_TIMEOUT = 0.8


def agent_source(
    r: RolloutConfig,
    max_prompt_length: int,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingConfig,
    pad_id: int,
    hang_timeout_s: float,
) -> AgentSource:
    """The run's agent (loaded again: checked before launch) with the endpoint's limits: one
    reply at most ``rollout.environment.max_turn_tokens`` (else ``max_response_length``) tokens, one segment
    at most the engine's context (``data.max_prompt_length + rollout.sampling.max_response_length``), and
    at most ``rollout.sampling.max_response_length`` tokens after its first prompt (its trained response,
    bounded like an environment's trajectory). A step's agents share
    :data:`AGENTS_SHARE_OF_HANG_TIMEOUT` of ``hang_timeout_s``."""
    assert r.agent is not None  # built for rollout.agent only
    settings = TurnSettings(
        model=SERVED_MODEL,
        seed=sampling.seed,
        max_turn_tokens=r.environment.max_turn_tokens or r.sampling.max_response_length,
        max_context_tokens=max_prompt_length + r.sampling.max_response_length,
        max_response_tokens=r.sampling.max_response_length,
    )
    return AgentSource(
        load_agent(r.agent),
        tokenizer,
        settings,
        AgentLimits(
            r.agent_concurrency,
            r.agent_timeout_s,
            batch_deadline_s=AGENTS_SHARE_OF_HANG_TIMEOUT * hang_timeout_s,
        ),
        sampling,
        pad_id,
    )
