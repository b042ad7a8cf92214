"""The step's batch layout: what the scheduler decided, before any backend planning.

Worked example (page_size 4): request A has 5 cached tokens and 1 new one, request B is a
fresh prompt of 3 tokens. q_lens [1, 3], kv_lens [6, 3], positions [5, 0, 1, 2],
cu_q [0, 1, 4], A's new token goes to cache index 5 = page A[1], offset 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchLayout:
    """q_lens[b]: new tokens of request b this step (packed in request order, T = sum).
    kv_lens[b]: tokens in b's cache AFTER this step's tokens are appended.
    block_tables[b]: b's page ids in order; None for cacheless (packed prefill) steps.
    positions: rotary positions [T]; default is the cache index (kv_len - q_len + i).
    tree_masks[b]: optional bool [q_len, m] over b's LAST m keys, q_len <= m <= kv_len
    (True = may attend); keys before them stay fully visible. m = q_len is a tree among the
    new tokens; m > q_len also masks earlier scratch entries (draft-tree construction, where
    a node sees only its ancestors among the nodes already cached). None means causal.
    """

    q_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]] | None = None
    page_size: int = 16
    positions: torch.Tensor | None = None
    tree_masks: list[torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        if len(self.q_lens) != len(self.kv_lens):
            raise ValueError("q_lens and kv_lens must have one entry per request")
        for b, (q, kv) in enumerate(zip(self.q_lens, self.kv_lens)):
            if q < 1 or kv < q:
                raise ValueError(f"request {b}: need 1 <= q_len <= kv_len, got {q}, {kv}")
        if self.block_tables is None and any(q != kv for q, kv in zip(self.q_lens, self.kv_lens)):
            raise ValueError("a cacheless layout cannot have cached context (q_len != kv_len)")
        if self.tree_masks is not None:
            if len(self.tree_masks) != len(self.q_lens):
                raise ValueError(f"tree_masks has {len(self.tree_masks)} entries for "
                                 f"{len(self.q_lens)} requests")
            for b, (q, kv, tm) in enumerate(zip(self.q_lens, self.kv_lens, self.tree_masks)):
                if tm is not None and (tm.dim() != 2 or tm.shape[0] != q
                                       or not q <= tm.shape[1] <= kv):
                    raise ValueError(f"request {b}: tree mask has shape {tuple(tm.shape)}, "
                                     f"expected ({q}, m) with {q} <= m <= {kv}")

    @classmethod
    def packed(cls, seq_lens: list[int]) -> "BatchLayout":
        """Cacheless causal layout for whole sequences (precompute, training)."""
        return cls(q_lens=list(seq_lens), kv_lens=list(seq_lens))

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens) and self.tree_masks is None

    def cu_q(self) -> list[int]:
        out = [0]
        for q in self.q_lens:
            out.append(out[-1] + q)
        return out

    def cache_indices(self) -> list[range]:
        """Per request, the cache indices its new tokens occupy."""
        return [range(kv - q, kv) for q, kv in zip(self.q_lens, self.kv_lens)]

    def position_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        if self.positions is not None:
            return self.positions.to(device)
        pos = [i for r in self.cache_indices() for i in r]
        return torch.tensor(pos, dtype=torch.long, device=device)

    def slot_mapping(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[T] int64 flat cache slot (page * page_size + offset) of every new token."""
        # Plain ints: a decode step maps one index per request, and building each request's
        # page-table tensor (page_slots) would cost O(pages) per step on the hot path.
        ps, slots = self.page_size, []
        for table, r in zip(self.block_tables, self.cache_indices()):
            slots.extend(table[i // ps] * ps + i % ps for i in r)
        return torch.tensor(slots, dtype=torch.long, device=device)


def page_slots(table: list[int], index: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache indices index [M] int64 of one request (its page ids `table`, in order) ->
    flat cache slots [M] = page * page_size + offset."""
    pages = torch.tensor(table, dtype=torch.long)[index // page_size]
    return pages * page_size + index % page_size
