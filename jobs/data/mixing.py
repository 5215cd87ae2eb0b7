"""Several data sources mixed by weight (``data.mix``) into one deterministic list of records.

An epoch holds as many records as the sources together; each source fills ``weight / sum of weights`` of
it. A source with more records than its share contributes a sample of them drawn by the seed, one with
fewer repeats them (whole copies, then a seeded sample of the rest). The result is shuffled by the seed,
so the same seed gives the same mix, and a resumed job reads the same batches.
"""

from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T")


def mix(groups: list[list[T]], weights: list[float], seed: int) -> tuple[list[T], list[int]]:
    """The mixed items of ``groups`` in ``weights``' proportions, and how many each group gave.

    Example:
        >>> mixed, counts = mix([list("abcd"), list("xy")], [1.0, 2.0], seed=0)
        >>> counts
        [2, 4]
    """
    assert len(groups) == len(weights) and all(groups), "every source holds records"
    total, weight_sum = sum(len(group) for group in groups), sum(weights)
    generator = torch.Generator().manual_seed(seed)
    mixed: list[T] = []
    counts = []
    for group, weight in zip(groups, weights, strict=True):
        copies, rest = divmod(max(1, round(total * weight / weight_sum)), len(group))
        sample = torch.randperm(len(group), generator=generator)[:rest].sort().values.tolist()
        taken = group * copies + [group[index] for index in sample]
        mixed += taken
        counts.append(len(taken))
    order = torch.randperm(len(mixed), generator=generator).tolist()
    return [mixed[index] for index in order], counts
