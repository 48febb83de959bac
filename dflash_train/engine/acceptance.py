"""The statistics of what speculative decoding accepted.

Owns tau (the mean of acceptance lengths over cycles), the tau of a prompt set (the mean over
turns of each turn's mean) and the histogram of acceptance lengths 1..B. An
acceptance length is what one verify cycle committed (decoder.Generation.acceptance_lengths);
the accepted run it comes from is `loss.accepted_run_length`, the one count training metrics
also use.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def mean_acceptance(lengths: Iterable[int]) -> float:
    """tau over cycles: the mean acceptance length (nan when there was no cycle)."""
    lengths = list(lengths)
    return sum(lengths) / len(lengths) if lengths else float("nan")


def turn_mean_tau(turns: Iterable[Sequence[int]]) -> float:
    """tau of a prompt set as the paper reports it: the mean over turns of each turn's mean
    acceptance length (turns without a cycle, answered by the prefill alone, are left out)."""
    means = [mean_acceptance(t) for t in turns if len(t)]
    return sum(means) / len(means) if means else float("nan")


def acceptance_histogram(lengths: Iterable[int], block_size: int) -> list[int]:
    """Counts of acceptance lengths 1..block_size (index 0 counts length 1)."""
    hist = [0] * block_size
    for n in lengths:
        if not 1 <= n <= block_size:
            raise ValueError(f"acceptance length {n} outside [1, {block_size}]")
        hist[n - 1] += 1
    return hist
