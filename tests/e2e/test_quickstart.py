"""The README's main job, ``make quickstart``, as a user runs it: the tiny character-level Llama
learns the vowel reward with GRPO on one process.

The job is run by ``bench.quickstart.run_quickstart`` (the bench that stores the 40-step curve the
README quotes in ``bench/results/quickstart.json``), here for its first 12 steps: the curve has
reached its plateau by then (stored run: 0.42 at step 1, 0.54 at step 4, 0.99+ from step 9 on,
1.00 from step 13), and the 28 steps after it would add half a minute of CI for no new claim.
"""

from __future__ import annotations

from pathlib import Path

from bench.quickstart import EDGE_STEPS, run_quickstart

STEPS = 12


def test_the_quickstart_learns_the_vowel_reward(tmp_path: Path) -> None:
    """Step 1 starts low (measured 0.42) and the last 4 of 12 steps are near 1 (measured 1.00);
    the validation pass at step 10 (the config's test_freq) scores the held-out prompts near 1
    too (measured 1.00). The bounds leave room for another CPU's rounding to sample differently."""
    run = run_quickstart(tmp_path, f"trainer.total_steps={STEPS}")
    assert run.steps == STEPS, run.console_tail
    rewards = run.reward_mean
    assert rewards[0] < 0.6, rewards
    assert run.first_mean < 0.7, rewards  # the mean of the first EDGE_STEPS steps
    assert run.last_mean > 0.9, rewards
    assert EDGE_STEPS == 4
    assert run.val_reward_mean[10] > 0.9, run.val_reward_mean
    # the console's last line prints the first and last step's reward (the README says so)
    assert run.summary_line == (
        f"reward/mean: first step {rewards[0]:.4f}, last step {rewards[-1]:.4f} over {STEPS} steps"
    ), run.console_tail
