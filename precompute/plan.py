"""Which records go into which shard, and in which batches they run.

The plan depends only on the records and the config, never on timing or ranks, so a resumed
or distributed run rebuilds the same shards byte for byte. Shards fill in dataset order up to
`shard_tokens`; inside a shard, records are sorted by length (longest first) into padded
batches of at most `batch_tokens` (B * max_len), which keeps padding waste small.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[list[int]]:
    """Record indices per shard; a record longer than shard_tokens gets a shard of its own."""
    shards: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and used + n > shard_tokens:
            shards.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        shards.append(cur)
    return shards


def plan_batches(indices: Sequence[int], lengths: Sequence[int],
                 batch_tokens: int) -> list[list[int]]:
    """Split a shard's record indices into length-sorted batches with B * max_len <= budget."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = lengths[cur[0]] if cur else lengths[i]  # longest first: cur[0] is the widest
        if cur and (len(cur) + 1) * width > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def plan_hash(parts: dict[str, Any]) -> str:
    """sha256 of everything that determines the shards' bytes."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
