"""The random stream of every sampled sequence of a run: one seed per sequence, never shared.

A seed names a sequence by where it sits in the run, not by which rank or engine draws it:

- ``rollout``: which ``generate`` of the run (training steps, dynamic sampling's extra draws and
  validation passes all count; a resumed run restores the count);
- ``sequence``: the sample's index among all samples of that rollout, over every data-parallel
  rank and engine (prompt ``i``'s sample ``j`` of ``n`` is ``i * n + j``);
- ``segment``: the part of the sample being generated: its model turn (multi-turn), or its round
  (a partial rollout's continuation after a weight update); 0 for the first.

Packed into one 63-bit integer: ``(rollout, segment)``, shifted by an offset derived from the
run's seed, in the high :data:`HIGH_BITS` bits; ``sequence`` plus an offset derived from those
high bits in the low :data:`LOW_BITS` bits. Distinct (rollout, segment, sequence) within a run
always give distinct seeds, whatever the layout (TP, DP, engines, an asynchronous rollout group)
or a restart. vLLM seeds sample ``j`` of a request seeded ``s`` with ``s + j``
(``v1/engine/parallel_sampling.py``): a request for prompt ``i`` carries the seed of its first
sample, ``i * n``, so its samples take ``i * n + j``, their own; the low offset stays below
``2**32 - 2**SEQUENCE_BITS``, so ``s + j`` never carries into the high bits.

Why the low 32 bits carry more than the sequence: torch's CPU generator (mt19937) keeps only
the low 32 bits of a seed, and so does vLLM's CPU build (seeds ``s`` and ``s + 2**32`` draw the
same tokens). With the sequence alone down there, every rollout of a CPU run drew the same
streams by sample position: step 7's sample 3 drew what step 1's sample 3 drew, and dynamic
sampling's redraw of a prompt gave back the same responses. The offset mixed from the high bits
makes the low 32 bits differ between rollouts and segments too (not guaranteed, as 32 bits
cannot hold every place of a run, but a collision needs two offsets within a rollout's sample
count of each other). CUDA's generator (Philox) takes all 64 bits.

Pure: neither torch nor vLLM is imported.
"""

from __future__ import annotations

from collections.abc import Sequence

SEQUENCE_BITS = 24  # samples of one rollout: up to 16.7 million
SEGMENT_BITS = 10  # turns or partial-rollout rounds of one sample: up to 1024
LOW_BITS = 32  # all a CPU generator keeps of a seed: the sequence + a (rollout, segment) offset
HIGH_BITS = 63 - LOW_BITS  # (rollout, segment), offset by the run's seed
ROLLOUT_LIMIT = 1 << (HIGH_BITS - SEGMENT_BITS)
_LOW_OFFSETS = (1 << LOW_BITS) - (1 << SEQUENCE_BITS)  # offset + sequence stays below 2**32
_GOLDEN = 0x9E3779B97F4A7C15  # odd: multiplying by it permutes the integers modulo 2^k
_MASK64 = (1 << 64) - 1


def _run_offset(run_seed: int) -> int:
    return (run_seed * _GOLDEN) % (1 << HIGH_BITS)


def _scramble(x: int) -> int:
    """A 64-bit avalanche mix (xor-shift, odd multiply, twice): a one-bit change of ``x`` flips
    about half the bits of the result."""
    x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & _MASK64
    x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & _MASK64
    return x ^ (x >> 33)


def _low_offset(high: int) -> int:
    """Where the sequences of the (rollout, segment) ``high`` start in the low bits: spread
    over ``[0, 2**32 - 2**SEQUENCE_BITS)`` so that CPU generators, which see only the low 32
    bits, draw apart across rollouts and segments."""
    return _scramble(high) % _LOW_OFFSETS


def sequence_seed(run_seed: int, rollout: int, sequence: int, segment: int = 0) -> int:
    """The seed of one sample's ``segment`` in rollout ``rollout`` of the run seeded
    ``run_seed`` (module doc); in ``[0, 2**63)``."""
    if not 0 <= sequence < 1 << SEQUENCE_BITS:
        raise ValueError(
            f"sample {sequence} of one rollout: at most {1 << SEQUENCE_BITS} samples per rollout "
            "get their own random stream; lower data.train_batch_size x rollout.sampling.n"
        )
    if not 0 <= segment < 1 << SEGMENT_BITS:
        raise ValueError(
            f"segment {segment}: at most {1 << SEGMENT_BITS} turns or partial-rollout rounds per "
            "sample get their own random stream; lower rollout.env's max_turns or raise "
            "rollout.placement.partial_chunk_tokens"
        )
    if not 0 <= rollout < ROLLOUT_LIMIT:
        raise ValueError(f"rollout {rollout} is past the {ROLLOUT_LIMIT} a run can seed")
    high = (((rollout << SEGMENT_BITS) | segment) + _run_offset(run_seed)) % (1 << HIGH_BITS)
    return (high << LOW_BITS) | (_low_offset(high) + sequence)


def request_seeds(
    run_seed: int,
    rollout: int,
    first_sequence: int,
    requests: int,
    n: int,
    segment: int = 0,
) -> list[int]:
    """Seeds of ``requests`` consecutive requests of ``n`` samples each, the first request's
    first sample being sample ``first_sequence`` of the rollout: request ``i`` carries the seed
    of its first sample, and the engine adds ``j`` for its sample ``j``."""
    n = max(1, n)
    last = first_sequence + requests * n - 1
    if requests and last >= 1 << SEQUENCE_BITS:
        sequence_seed(run_seed, rollout, last, segment)  # raises, naming the limit
    return [
        sequence_seed(run_seed, rollout, first_sequence + i * n, segment) for i in range(requests)
    ]


def sample_seeds(request_seeds: Sequence[int], n: int) -> list[int]:
    """The seed each sample draws with, in prompt-major order (sample ``j`` of request ``i`` at
    ``i * n + j``), as vLLM derives them from the requests' seeds."""
    return [s + j for s in request_seeds for j in range(max(1, n))]


__all__ = ["LOW_BITS", "SEQUENCE_BITS", "request_seeds", "sample_seeds", "sequence_seed"]
