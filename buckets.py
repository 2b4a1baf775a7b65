"""Length-bucketing arithmetic shared by data preparation (data_prep.py stats) and rollout.

Prompts are grouped by ceil(length / bucket_size) and each generation batch is padded to its
bucket's bound, so the accelerator sees a few fixed widths instead of whatever the longest
prompt of a batch happens to be (article 3.3: "measure the lengths first, then cut into
buckets").
"""
from __future__ import annotations

import math
import random
from typing import Sequence

import numpy as np


def bucket_bound(length: int, bucket_size: int) -> int:
    """The width a prompt of this length is padded to: the next multiple of bucket_size."""
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
    return math.ceil(length / bucket_size) * bucket_size


def bucketed_batches(prompt_lengths: Sequence[int], batch_size: int, bucket_size: int, *,
                     seed: int, epoch: int = 0) -> list[list[int]]:
    """Generation batches of prompt indices, each batch drawn from a single length bucket.

    Bucket of a prompt: ceil(length / bucket_size). Indices are shuffled within each bucket,
    cut into batches of batch_size (the last batch of a bucket may be shorter), and the batches
    of all buckets shuffled together. Every index appears exactly once. The order depends only
    on (seed, epoch), through a local RNG: the global random state is neither read nor moved.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
    if any(length < 0 for length in prompt_lengths):
        raise ValueError("prompt lengths must be >= 0")
    rng = random.Random(f"bucketed_batches:{seed}:{epoch}")
    buckets: dict[int, list[int]] = {}
    for index, length in enumerate(prompt_lengths):
        buckets.setdefault(math.ceil(length / bucket_size), []).append(index)
    batches: list[list[int]] = []
    for bucket in sorted(buckets):
        members = buckets[bucket]
        rng.shuffle(members)
        batches.extend(members[start:start + batch_size] for start in range(0, len(members), batch_size))
    rng.shuffle(batches)
    return batches


def batch_max_widths(prompt_lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> list[int]:
    """Per prompt, the width it is padded to when its batch pads to the batch's longest prompt."""
    widths = [0] * len(prompt_lengths)
    for batch in batches:
        width = max(prompt_lengths[i] for i in batch)
        for i in batch:
            widths[i] = width
    return widths


def padding_fraction(prompt_lengths: Sequence[int], padded_widths: Sequence[int]) -> float:
    """Padding tokens / all tokens (real + padding) once prompt i is padded to padded_widths[i]."""
    total = sum(padded_widths)
    return (total - sum(prompt_lengths)) / total if total else 0.0


MAX_BUCKET_PADDING = 0.25
MIN_BUCKET_SIZE = 8


def propose_bucket_size(prompt_lengths: Sequence[int], max_padding: float = MAX_BUCKET_PADDING) -> int:
    """The largest power of two, from 8 up to the first power of two >= the median length, whose
    buckets pad at most max_padding of the tokens; the smallest candidate if none does.

    Larger buckets mean fewer distinct shapes for the accelerator (the article's point: NPUs
    handle a few static shapes far better than many ragged ones); the padding budget keeps the
    wasted compute bounded. Capping at the median's power of two reproduces the article's
    choice of 1024 for prompts averaging 800 tokens when lengths are concentrated near the mean.
    Padding under bucketing does not depend on how batches are drawn: every prompt pads to its
    own bucket's bound.
    """
    if not prompt_lengths:
        raise ValueError("no prompt lengths")
    median = float(np.median(prompt_lengths))
    candidates = [MIN_BUCKET_SIZE]
    while candidates[-1] < median:
        candidates.append(candidates[-1] * 2)
    for bucket_size in reversed(candidates):
        widths = [bucket_bound(length, bucket_size) for length in prompt_lengths]
        if padding_fraction(prompt_lengths, widths) <= max_padding:
            return bucket_size
    return candidates[0]
