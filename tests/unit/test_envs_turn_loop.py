"""The turn loop over the rollout engine seam, with a scripted engine: one generate call per turn
for every active trajectory, per-request seeds and budgets, the response mask marking exactly the
model's tokens, budgets and turn limits, environment failures, rewards and metrics, and
trajectories that do not depend on how samples are split over engines."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from megarl.envs import ChatDeltas, EnvError, Environment, Step, ToolPool
from megarl.envs.runner import EnvRunner, env_seed
from megarl.envs.trajectory import check_env_failures, trajectory_metrics
from megarl.rollout.multi_turn import TurnLimits, run_trajectories
from megarl.rollout.rollout_split import SampleStart
from megarl.rollout.rollout_types import RolloutOutput, SamplingConfig
from megarl.rollout.seeds import request_seeds, sample_seeds, sequence_seed
from tests.assets import qwen25_tokenizer_dir

pytestmark = pytest.mark.unit


class Quiz(Environment):
    """Asks a follow-up until the model has answered ``rounds`` times; rewards 1 on turn 2."""

    def __init__(self, rounds: int = 2, fail_on: str | None = None):
        self.rounds, self.fail_on, self.seen = rounds, fail_on, 0

    def reset(self, row):
        if self.fail_on == "reset" and row["id"] == 1:
            raise RuntimeError("reset broke")
        return [{"role": "user", "content": f"question {row['id']} draw {self.rng.randint(0, 99)}"}]

    def step(self, messages):
        self.seen += 1
        if self.fail_on == "step" and self.seen == 2:
            return {"not": "a step"}
        if self.seen >= self.rounds:
            return Step(done=True, reward=1.0 if self.seen == 2 else None)
        return Step(
            messages=[{"role": "user", "content": f"and then? ({self.seen})"}], metrics={"asks": 1}
        )


class ScriptedEngine:
    """Answers each request with tokens derived from its seed (the same request, the same
    answer, whatever else is in the call); ``sampling.n`` samples a request, sample j drawing
    with the request's seed + j, as vLLM seeds them; records every call."""

    def __init__(self, tokenizer, words: int = 3):
        self.tok, self.words, self.calls, self.seeds = tokenizer, words, [], []

    def generate(self, prompts, sampling, seed_offset=0, *, seeds=None, max_new_tokens=None):
        seeds = seeds or [sampling.seed + seed_offset + i for i in range(len(prompts))]
        budgets = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        self.calls.append((len(prompts), [len(p) for p in prompts], list(budgets)))
        self.seeds.append((sampling.n, list(seeds)))
        out = RolloutOutput()
        for i, (seed, budget) in enumerate(zip(seeds, budgets, strict=True)):
            for j in range(sampling.n):
                words = " ".join(f"w{(seed + j) % 97}" for _ in range(self.words))
                ids = self.tok(words, add_special_tokens=False)["input_ids"]
                ids = [*ids, self.tok.eos_token_id][:budget]
                out.prompt_index.append(i)
                out.token_ids.append(ids)
                out.logprobs.append([-0.5] * len(ids))
                out.finish_reasons.append("stop" if ids[-1] == self.tok.eos_token_id else "length")
        return out


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(qwen25_tokenizer_dir())


def _runner(tok, **kwargs):
    return EnvRunner(
        Quiz,
        kwargs,
        ChatDeltas(tok),
        ToolPool(2, 5.0),
        run_seed=7,
        stop_token_ids=[tok.eos_token_id],
        max_prompt_tokens=200,
    )


def _starts(tok, ids):
    return [
        SampleStart(sample=i, row={"id": i, "prompt": "q"}, fallback_prompt=tok("q")["input_ids"])
        for i in ids
    ]


SAMPLING = SamplingConfig(temperature=1.0, n=1, seed=3)


def _run(tok, ids, limits, engine=None, **env_kwargs):
    engine = engine or ScriptedEngine(tok)
    return run_trajectories(
        engine,
        _starts(tok, ids),
        _runner(tok, **env_kwargs),
        SAMPLING,
        limits,
        rollout_index=5,
        pad_id=0,
    ), engine


def test_turns_are_batched_and_the_mask_marks_the_model_tokens(tok):
    limits = TurnLimits(max_turns=4, max_response_tokens=200, max_turn_tokens=50)
    trajs, engine = _run(tok, range(4), limits, rounds=2)
    assert [c[0] for c in engine.calls] == [4, 4]  # one call per turn, all trajectories in it
    deltas = ChatDeltas(tok)
    for t in trajs:
        assert t.finish == "stop" and t.turns == 2 and t.env_reward == 1.0 and t.env_scored_outcome
        assert len(t.response_ids) == len(t.mask) == len(t.logprobs)
        model = [i for i, m in zip(t.response_ids, t.mask, strict=True) if m]
        env = [i for i, m in zip(t.response_ids, t.mask, strict=True) if not m]
        # environment tokens are exactly the template's delta for the follow-up question
        assert env == deltas.env_ids([{"role": "user", "content": "and then? (1)"}], "<|im_end|>")
        assert tok.decode(model).count("<|im_end|>") == 2  # two model turns, each stopped
        assert all(lp == -0.5 for lp, m in zip(t.logprobs, t.mask, strict=True) if m)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask, strict=True) if not m)
        assert [t.mask[e] for e in t.turn_ends] == [1, 1]
        assert t.messages[-1]["role"] == "assistant" and t.final_text.startswith("w")
        # what the rule scorer reads: the last turn's ids, its stop token dropped in decoding
        assert t.final_turn_ids == t.response_ids[t.turn_ends[0] + 1 + len(env) :]
        assert tok.decode(t.final_turn_ids, skip_special_tokens=True) == t.final_text
    metrics = trajectory_metrics(trajs, 0.0)
    assert metrics["rollout/turns_mean"] == 2 and metrics["rollout/turns_max"] == 2
    assert metrics["rollout/env_tokens_mean"] == len(env) and metrics["rollout/truncated"] == 0
    assert metrics["rollout/env/asks_mean"] == 1.0
    assert metrics["rollout/budget_cut"] == 0


def test_budgets_and_turn_limits_truncate(tok):
    trajs, engine = _run(
        tok,
        range(2),
        TurnLimits(max_turns=2, max_response_tokens=500, max_turn_tokens=50),
        rounds=5,
    )
    assert all(t.finish == "turns" and t.truncated and t.turns == 2 for t in trajs)
    # ended by rollout.environment.max_turns, not by the response budget
    assert trajectory_metrics(trajs, 0.0)["rollout/budget_cut"] == 0
    # the last turn unrewarded: the run's reward scores the final conversation
    assert all(t.env_reward == 0 and not t.env_scored_outcome for t in trajs)
    # the per-turn budget shrinks with what the trajectory has used
    trajs, engine = _run(
        tok, [0], TurnLimits(max_turns=9, max_response_tokens=30, max_turn_tokens=4), rounds=9
    )
    t = trajs[0]
    assert t.finish == "length" and len(t.response_ids) <= 30
    # the budget, not max_turns, ended it: what rollout/budget_cut counts
    assert (
        t.turns < 9 and t.budget_cut and trajectory_metrics(trajs, 0.0)["rollout/budget_cut"] == 1
    )
    for _, [length], [budget] in engine.calls:  # per turn: min(turn limit, what is left)
        assert budget == min(4, 30 - (length - len(t.prompt_ids)))
    # a turn cut by its limit has no stop token; its close is the template's whole end of turn
    assert tok.eos_token_id not in t.response_ids[: t.turn_ends[0] + 1]
    assert tok.decode(t.response_ids[t.turn_ends[0] + 1 :]).startswith(
        "<|im_end|>\n<|im_start|>user"
    )


def test_environment_messages_that_eat_the_budget_cut_turns_and_are_counted(tok):
    """Three turns of at most 8 tokens fit 30 tokens alone, not with the follow-up questions
    between them: the trajectory ends at the budget before its last turn, and says so."""
    limits = TurnLimits(max_turns=3, max_response_tokens=30, max_turn_tokens=8)
    trajs, _ = _run(tok, range(2), limits, rounds=9)
    assert all(t.turns < 3 and t.truncated and t.budget_cut for t in trajs), [
        (t.turns, t.finish) for t in trajs
    ]
    assert trajectory_metrics(trajs, 0.0)["rollout/budget_cut"] == 1
    # with room for the follow-ups the same trajectories reach max_turns
    roomy = TurnLimits(max_turns=3, max_response_tokens=200, max_turn_tokens=8)
    trajs, _ = _run(tok, range(2), roomy, rounds=9)
    assert all(t.turns == 3 and t.finish == "turns" and not t.budget_cut for t in trajs)


def test_a_failing_environment_fails_its_sample_only(tok):
    limits = TurnLimits(max_turns=4, max_response_tokens=200, max_turn_tokens=50)
    trajs, _ = _run(tok, range(3), limits, rounds=3, fail_on="reset")
    failed = trajs[1]
    assert failed.finish == "error" and "reset broke" in failed.error
    assert failed.mask == [0] and failed.prompt_ids == tok("q")["input_ids"]
    assert trajs[0].finish == "stop" and trajs[2].finish == "stop"
    # rollout.environment.max_env_failures: 1 of 3 failed passes a share of 0.5, stops the run at 0.3
    check_env_failures(trajs, 0.5)
    with pytest.raises(
        EnvError, match=r"(?s)1 of the step's 3 samples.*0\.3.*sample 1.*reset broke"
    ):
        check_env_failures(trajs, 0.3)
    trajs, _ = _run(tok, range(2), limits, rounds=3, fail_on="step")
    assert all(t.finish == "error" and "must return megarl.envs.Step" in t.error for t in trajs)
    assert trajectory_metrics(trajs, 0.0)["rollout/env_failures"] == 2
    check_env_failures(trajs, 1.0)  # every sample may fail
    with pytest.raises(EnvError, match="2 of the step's 2 samples"):
        check_env_failures(trajs, 0.0)


def test_trajectories_do_not_depend_on_the_split_over_engines(tok):
    limits = TurnLimits(max_turns=3, max_response_tokens=200, max_turn_tokens=50)
    whole, _ = _run(tok, range(6), limits, rounds=3)
    halves = _run(tok, range(3), limits, rounds=3)[0] + _run(tok, range(3, 6), limits, rounds=3)[0]
    assert [t.response_ids for t in whole] == [t.response_ids for t in halves]
    assert [t.prompt_ids for t in whole] == [t.prompt_ids for t in halves]
    assert len({tuple(t.response_ids) for t in whole}) == 6  # seeds differ per sample and turn
    assert env_seed(7, 5, 0) != env_seed(7, 5, 1) != env_seed(7, 6, 0)


class Echo(Environment):
    """The row's prompt as it is, one turn, nothing added: the single-turn rollout's case."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        return Step(done=True)


def test_a_first_turn_from_shared_prompts_is_the_single_turn_request(tok):
    """Samples of a prompt that start alike go to the engine as that prompt's one request of n
    samples with the single-turn seed: the tokens of the run without an environment. Samples
    that start apart are sent one by one with the seeds such a request gives its samples."""
    n, rollout_index, prompts = 4, 3, 5
    sampling = SamplingConfig(temperature=1.0, n=n, seed=11, max_new_tokens=6)
    deltas = ChatDeltas(tok)
    rows = [{"id": g, "prompt": f"question {g}"} for g in range(prompts)]
    heads = [deltas.prompt_ids([{"role": "user", "content": r["prompt"]}], None) for r in rows]
    # the single-turn rollout's request seeds (megarl.rollout.engine's generate)
    single_seeds = request_seeds(sampling.seed, rollout_index, 0, prompts, n)
    single = ScriptedEngine(tok, words=1).generate(heads, sampling, seeds=single_seeds)

    def run(env, samples, words, budget=6):
        engine = ScriptedEngine(tok, words=words)
        runner = EnvRunner(env, {}, deltas, ToolPool(2, 5.0), 7, [tok.eos_token_id], 200)
        starts = [SampleStart(s, rows[s // n], []) for s in samples]
        limits = TurnLimits(max_turns=3, max_response_tokens=budget, max_turn_tokens=6)
        trajs = run_trajectories(
            engine, starts, runner, sampling, limits,
            rollout_index=rollout_index, pad_id=0,
        )  # fmt: skip
        return trajs, engine

    # one engine holding prompts 1-3 of the step: one request per prompt, n samples each
    trajs, engine = run(Echo, range(n, 4 * n), words=1)
    assert engine.seeds == [(n, single_seeds[1:4])]
    assert [t.response_ids for t in trajs] == single.token_ids[n : 4 * n]
    assert [t.logprobs for t in trajs] == single.logprobs[n : 4 * n]
    assert all(t.finish == "stop" and t.turns == 1 and all(t.mask) for t in trajs)
    # a last turn cut at its budget leaves the trajectory truncated, as in a single-turn rollout
    trajs, _ = run(Echo, range(n), words=9)
    assert all(t.finish == "length" and t.truncated and len(t.response_ids) == 6 for t in trajs)
    # prompts drawn per sample (Quiz): per-sample requests, the same seeds per (prompt, j)
    trajs, engine = run(Quiz, range(n, 3 * n), words=1, budget=200)
    n_first, first_seeds = engine.seeds[0]
    assert n_first == 1
    assert first_seeds == [single_seeds[s // n] + s % n for s in range(n, 3 * n)]
    later = [seed for _, seeds in engine.seeds[1:] for seed in seeds]
    # later turns draw apart: each (sample, turn) its own stream, none a first turn's
    own = {sequence_seed(11, rollout_index, s, turn) for s in range(n, 3 * n) for turn in (1, 2)}
    assert later and set(later) <= own and len(set(later)) == len(later)
    assert not set(later) & set(sample_seeds(single_seeds, n))
