"""How a trajectory's reward is made: the environment's turn rewards, plus the run's rule scorer
on the final answer when the environment leaves the final turn unrewarded; 0 for a failed
sample; each turn's reward on its last model token, the rest on the last model token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from megarl.config import OverlongBufferConfig
from megarl.data import PromptItem
from megarl.envs.trajectory import Trajectory
from megarl.rewards.manager import RewardManager
from megarl.rewards.shares import Mean, combination
from megarl.rollout.rollout_batch import RolloutBatch
from megarl.trainer.experience import RewardSources, score_rollout
from megarl.trainer.model_ops import MicroBatching
from tests.assets import qwen25_tokenizer_dir

pytestmark = pytest.mark.unit


def _trajectory(tok, sample, rewards, answer, finish="stop"):
    """Model turns of two tokens, then the answer's tokens and the stop token."""
    t = Trajectory(sample=sample, prompt_ids=[5, 6, 7])
    for k, r in enumerate(rewards):
        last = k == len(rewards) - 1
        ids = [*tok.encode(answer), tok.eos_token_id] if last else [10 + k, 11 + k]
        t.add_model_turn(ids, [-0.1] * len(ids))
        t.turn_rewards.append(r)
        if k < len(rewards) - 1:
            t.add_env_tokens([1, 2, 3])
    t.messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": answer},
    ]
    t.end(finish, "boom" if finish == "error" else None)
    return t


def test_environment_rewards_and_the_rule_scorer_combine():
    tok = AutoTokenizer.from_pretrained(qwen25_tokenizer_dir())
    trajs = [
        _trajectory(tok, 0, [0.5, 1.0], "The answer is 9."),  # the env scored the outcome: 1.5
        _trajectory(tok, 1, [0.2, None], "The answer is 5."),  # + the scorer's 1.0: 1.2
        _trajectory(tok, 2, [None, None], "It is 4."),  # the scorer's 0.0
        _trajectory(tok, 3, [0.2, None], "The answer is 5.", finish="error"),  # failed: 0
    ]
    batch = RolloutBatch(trajs, [0, 0, 0, 0], conversations=True)
    item = PromptItem(
        uid=0, input_ids=[5, 6, 7], prompt="q", data_source="arithmetic", ground_truth="5"
    )
    rewards = RewardSources(RewardManager(), None, 1.0, 1.0, OverlongBufferConfig(), 64)
    samples, scores, metrics, texts = score_rollout(
        rewards, tok, 0, [item], batch, MicroBatching(), shaping=False
    )
    assert scores.tolist() == pytest.approx([1.5, 1.2, 0.0, 0.0])
    # the scorer read the last turn's tokens, the stop token dropped
    assert texts[1] == "The answer is 5." and texts[2] == "It is 4."
    tokens = samples.tensors.require("token_level_scores")
    assert tokens.sum(-1).tolist() == pytest.approx(scores.tolist())
    # turn ends: 1 (first turn) and the last answer token (after 3 environment tokens)
    end = trajs[0].turn_ends[1]
    assert samples.response_mask[0].tolist()[: end + 1] == [1, 1, 0, 0, 0] + [1] * (end - 4)
    assert tokens[0, 1] == pytest.approx(0.5) and tokens[0, end] == pytest.approx(1.0)
    assert tokens[1, 1] == pytest.approx(0.2) and tokens[1, end] == pytest.approx(1.0)
    assert torch.all(tokens[:, 2:5] == 0)
    assert metrics["reward/rule_mean"] == pytest.approx(0.5)  # scored: samples 1 and 2
    assert metrics["reward/env_outcome_share"] == pytest.approx(0.25)
    # over DP ranks, the rule mean is weighted by the samples scored, the environment's by all
    assert metrics["reward/samples"] == 2 and metrics["reward/rollout_samples"] == 4
    assert combination("reward/rule_mean", metrics) == Mean("reward/samples")
    assert combination("reward/env_mean", metrics) == Mean("reward/rollout_samples")
    assert [k for k in metrics if combination(k, metrics) is None] == ["reward/mean"]
    rewards.close()
