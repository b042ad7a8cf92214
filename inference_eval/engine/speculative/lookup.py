"""Lookup drafting: draft tokens copied from n-grams, with no model in the loop.

Two sources, tried in this order at every draft position (each on the request's tokens plus
the drafts proposed so far in the round):
- `ContextIndex`, prompt lookup: the longest suffix (max_n down to min_n tokens) that occurred
  earlier in the request's own prompt and output proposes the token that followed its latest
  occurrence. Small targets repeat themselves and their prompts; this is free where they do.
- `NgramTable`, a corpus of the target's own text (REST-style retrieval; the self-distilled
  answers of precompute shards): the longest suffix whose most frequent continuation in the
  corpus is also the majority one (min_count occurrences, more than min_share of them).

Either source only proposes: the target verifies every draft, so a wrong or stale guess
(including a 64-bit hash collision in the table) costs acceptance, never losslessness.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

_MUL = 0x9E3779B97F4A7C15  # odd 64-bit multiplier (golden ratio): a cheap polynomial hash
_MASK = (1 << 64) - 1


def ngram_hash(tokens: Sequence[int]) -> int:
    """The table's key of an n-gram: h = h * MUL + (t + 1) mod 2^64, token by token (the same
    arithmetic as the vectorised build, where uint64 products wrap)."""
    h = 0
    for t in tokens:
        h = (h * _MUL + int(t) + 1) & _MASK
    return h


class NgramTable:
    """Corpus n-grams of min_n..max_n tokens -> the token that follows them most often.

    tables[n - min_n]: {ngram_hash: token}. Only continuations seen at least `min_count` times
    and in more than `min_share` of the n-gram's occurrences are kept (a guess that the corpus
    itself disagrees about would be rejected as often as not); ties go to the lowest id."""

    def __init__(self, tables: list[dict[int, int]], min_n: int, max_n: int) -> None:
        if len(tables) != max_n - min_n + 1:
            raise ValueError(f"{len(tables)} tables for n-grams of {min_n}..{max_n} tokens")
        self.tables, self.min_n, self.max_n = tables, min_n, max_n

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables)

    @classmethod
    def build(cls, sequences: Iterable[np.ndarray], follower_masks: Iterable[np.ndarray] | None = None,
              min_n: int = 2, max_n: int = 6, min_count: int = 2, min_share: float = 0.5) -> "NgramTable":
        """sequences: token ids [N_i] each; follower_masks: bool [N_i] each, True where a token
        may be proposed (e.g. the loss mask: answers, not prompts; None = every token). An
        n-gram is counted within one sequence, followed by a masked-in token."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"lookup n-gram lengths must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        seqs = [np.asarray(s, dtype=np.int64) for s in sequences]
        masks = ([np.ones(len(s), dtype=bool) for s in seqs] if follower_masks is None
                 else [np.asarray(m, dtype=bool) for m in follower_masks])
        if len(masks) != len(seqs) or any(len(m) != len(s) for m, s in zip(masks, seqs)):
            raise ValueError("follower_masks must have one mask per sequence, of its length")
        flat = np.concatenate(seqs) if seqs else np.zeros(0, np.int64)
        follow = np.concatenate(masks) if masks else np.zeros(0, bool)
        start = np.concatenate([np.full(len(s), o, np.int64) for s, o in
                                zip(seqs, np.cumsum([0] + [len(s) for s in seqs[:-1]]))]) \
            if seqs else np.zeros(0, np.int64)
        idx = np.arange(len(flat), dtype=np.int64)
        tables = []
        with np.errstate(over="ignore"):
            for n in range(min_n, max_n + 1):
                at = idx[follow & (idx - n >= start)]  # followers with n tokens before them
                h = np.zeros(len(at), dtype=np.uint64)
                for j in range(n):
                    h = h * np.uint64(_MUL) + (flat[at - n + j] + 1).astype(np.uint64)
                tables.append(_majority(h, flat[at], min_count, min_share))
        return cls(tables, min_n, max_n)

    def next_token(self, tokens: Sequence[int]) -> int | None:
        """The continuation of the longest suffix of `tokens` the table knows, or None."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            t = self.tables[n - self.min_n].get(ngram_hash(tokens[len(tokens) - n:]))
            if t is not None:
                return t
        return None


def _majority(keys: np.ndarray, follower: np.ndarray, min_count: int, min_share: float) -> dict[int, int]:
    """keys [M] uint64, follower [M] -> {key: majority follower} (see NgramTable)."""
    if len(keys) == 0:
        return {}
    order = np.lexsort((follower, keys))
    k, f = keys[order], follower[order]
    new_pair = np.ones(len(k), bool)
    new_pair[1:] = (k[1:] != k[:-1]) | (f[1:] != f[:-1])
    first = np.flatnonzero(new_pair)
    pk, pf = k[first], f[first]
    pc = np.diff(np.append(first, len(k)))  # occurrences of each (key, follower) pair
    # Per key: the most frequent follower (lowest id on ties) and the key's total count.
    best = np.lexsort((pf, -pc, pk))
    bk, bf, bc = pk[best], pf[best], pc[best]
    head = np.ones(len(bk), bool)
    head[1:] = bk[1:] != bk[:-1]
    starts = np.flatnonzero(head)
    total = np.add.reduceat(bc, starts)
    keep = (bc[starts] >= min_count) & (bc[starts] > min_share * total)
    return dict(zip(bk[starts][keep].tolist(), bf[starts][keep].tolist()))


class ContextIndex:
    """Prompt lookup over one request's tokens: `last[ngram]` is the index of the token that
    followed that n-gram's latest occurrence. `sync` appends what the request emitted since."""

    def __init__(self, min_n: int = 2, max_n: int = 8) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"lookup match lengths must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}

    def sync(self, tokens: Sequence[int]) -> None:
        """Index tokens[len(self.tokens):] (the request's tokens only ever grow)."""
        for i in range(len(self.tokens), len(tokens)):
            t = tokens[i]
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self.last[tuple(self.tokens[i - n:i])] = i
            self.tokens.append(int(t))

    def next_token(self, tokens: Sequence[int]) -> int | None:
        """The token after the latest earlier occurrence of the longest suffix of `tokens`
        (the indexed tokens, possibly followed by drafts), or None."""
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            i = self.last.get(tuple(tokens[len(tokens) - n:]))
            if i is not None:
                return self.tokens[i]
        return None


def lookup_chain(context: ContextIndex, table: NgramTable | None, k: int) -> list[int]:
    """Up to k drafts after the context's tokens: at each position the context's own
    continuation first, the corpus table's second; the chain stops where neither knows one."""
    # Only suffixes of at most max_n tokens are ever looked up (the context index also needs
    # one token before its longest): copying that window, not the whole history, each round.
    longest = max(context.max_n, table.max_n if table is not None else 0) + 1
    seq = context.tokens[-longest:]
    drafts: list[int] = []
    for _ in range(k):
        t = context.next_token(seq)
        if t is None and table is not None:
            t = table.next_token(seq)
        if t is None:
            break
        drafts.append(t)
        seq.append(t)
    return drafts
