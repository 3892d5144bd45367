"""The environment of the multi-turn e2e runs, in a file of its own as a user's would be
(``rollout.env=tests/e2e/relay_env.py:Relay``): it imports only megarl, so the training
processes load it by path without the test suite on their import path."""

from __future__ import annotations

from megarl.envs import Environment, Step

VOWELS = set("aeiou")
FOLLOW_UP = "Say more, turn {k}."


class Relay(Environment):
    """Two model turns: the first answered with a follow-up question; each turn rewarded by its
    share of vowels (learnable by a tiny model in a few steps); with ``pass_share`` only the last
    turn, pass/fail (1.0 from that share of vowels up), so that whole groups often score alike
    (what dynamic sampling filters)."""

    def __init__(
        self, turns: int = 2, log_file: str | None = None, pass_share: float | None = None
    ):
        self.turns, self.seen, self.log_file = turns, 0, log_file
        self.pass_share = pass_share

    def reset(self, row):
        if self.log_file:  # a side effect: one line per reset, wherever it runs
            with open(self.log_file, "a") as f:
                f.write(f"{self.seed}\n")
        prompt = row["prompt"]
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        return [{"role": "user", "content": f"{text[:30]} ({self.rng.randint(0, 9)})"}]

    def step(self, messages):
        self.seen += 1
        text = messages[-1]["content"]
        reward = sum(c in VOWELS for c in text) / max(len(text), 1)
        if self.seen >= self.turns:
            if self.pass_share is not None:
                reward = float(reward >= self.pass_share)
            return Step(reward=reward, done=True)
        follow = {"role": "user", "content": FOLLOW_UP.format(k=self.seen)}
        reward = None if self.pass_share is not None else reward
        return Step(messages=[follow], reward=reward, metrics={"follow_ups": 1})


class OneTurn(Environment):
    """The degenerate environment: the row's prompt as it is, one model turn, no messages and no
    reward of its own (so the run's rule scorer scores the turn). A run with it must equal the
    run without ``rollout.env``, metric for metric."""

    def reset(self, row):
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(m) for m in prompt]

    def step(self, messages):
        return Step(done=True)
