"""Attention of DFlash blocks in training: every block sees its sequence's context before its
anchor (causal to the context) and every row of its own block (bidirectional inside it).

A block anchored at local position a of a sequence has B rows at rotary positions a..a+B-1:
row 0 holds x_a (the last verified token in the engine), rows 1..B-1 the mask token. Its
queries see

    context keys j < a of the same sequence    (the target's injected states, heads/dflash.py)
    block keys   of the same block, all B      (whatever their order)

and nothing of another block or another sequence. The engine writes the same context keys
into the draft's paged cache and attends over [context ; block] with a tree mask of ones over
the block (engine/speculative/block_drafters.py), which is this mask for one block.

Worked example, one sequence of 5 tokens, B = 3, anchors 1 and 3 (rows r0..r5):

| query rows      | context keys visible | block keys visible |
|-----------------|----------------------|--------------------|
| r0, r1, r2 (a=1)| 0                    | r0, r1, r2         |
| r3, r4, r5 (a=3)| 0, 1, 2              | r3, r4, r5         |
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def block_attention_mask(seq_lens: list[int], anchors: list[list[int]], block: int) -> torch.Tensor:
    """seq_lens: S sequence lengths; anchors[s]: local anchor positions of sequence s ->
    bool [S, R, Tmax + R] (R = max blocks x B query rows, Tmax = max length): row i of
    sequence s may see key j (context keys first, then the padded block rows). Padded query
    rows see block key 0 only (their output is dropped; SDPA needs a visible key)."""
    s, tmax = len(seq_lens), max(seq_lens)
    rmax = max(max((len(a) for a in anchors), default=0), 1) * block
    mask = torch.zeros(s, rmax, tmax + rmax, dtype=torch.bool)
    for si, anc in enumerate(anchors):
        for j, a in enumerate(anc):
            rows = slice(j * block, (j + 1) * block)
            mask[si, rows, :a] = True
            mask[si, rows, tmax + j * block:tmax + (j + 1) * block] = True
        mask[si, len(anc) * block:, tmax] = True
    return mask


class BlockPlan:
    """Index maps of one batch's blocks, built once: packed context rows [N] <-> [S, Tmax],
    packed block rows [J*B] <-> [S, R], the mask and each block row's rotary position."""

    def __init__(self, seq_lens: list[int], anchors: torch.Tensor, block: int,
                 device: torch.device | str = "cpu") -> None:
        """anchors [J] int64: global packed indices, ascending (so grouped by sequence)."""
        self.seq_lens, self.block = seq_lens, block
        starts = torch.tensor([0] + seq_lens[:-1]).cumsum(0).tolist()
        seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
        per_seq: list[list[int]] = [[] for _ in seq_lens]
        for g in anchors.tolist():
            s = int(seq_of[g])
            per_seq[s].append(g - starts[s])
        self.local_anchors = per_seq
        self.batch, self.tmax = len(seq_lens), max(seq_lens)
        self.rmax = max(max((len(a) for a in per_seq), default=0), 1) * block
        ctx_rows = [s * self.tmax + i for s, n in enumerate(seq_lens) for i in range(n)]
        blk_rows = [s * self.rmax + j * block + i for s, anc in enumerate(per_seq)
                    for j in range(len(anc)) for i in range(block)]
        self.ctx_rows = torch.tensor(ctx_rows, dtype=torch.long, device=device)
        self.blk_rows = torch.tensor(blk_rows, dtype=torch.long, device=device)
        self.ctx_positions = torch.tensor([i for n in seq_lens for i in range(n)], dtype=torch.long,
                                          device=device)
        self.positions = torch.tensor([a + i for anc in per_seq for a in anc for i in range(block)],
                                      dtype=torch.long, device=device)  # [J*B]
        self.mask = block_attention_mask(seq_lens, per_seq, block).to(device)

    @staticmethod
    def _pad(x: torch.Tensor, rows: torch.Tensor, b: int, width: int) -> torch.Tensor:
        out = x.new_zeros((b * width, *x.shape[1:])).index_copy(0, rows, x)
        return out.view(b, width, *x.shape[1:])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_k: torch.Tensor,
               ctx_v: torch.Tensor) -> torch.Tensor:
        """q [J*B, heads, d], k / v [J*B, kv_heads, d] of the block rows; ctx_k / ctx_v
        [N, kv_heads, d] of the packed context (rotated at their own positions) ->
        [J*B, heads, d]."""
        b, heads, kvh = self.batch, q.shape[1], k.shape[1]
        qp = self._pad(q, self.blk_rows, b, self.rmax).transpose(1, 2)
        keys = torch.cat([self._pad(ctx_k, self.ctx_rows, b, self.tmax),
                          self._pad(k, self.blk_rows, b, self.rmax)], 1).transpose(1, 2)
        vals = torch.cat([self._pad(ctx_v, self.ctx_rows, b, self.tmax),
                          self._pad(v, self.blk_rows, b, self.rmax)], 1).transpose(1, 2)
        out = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=self.mask.unsqueeze(1),
                                             enable_gqa=heads != kvh)
        return out.transpose(1, 2).reshape(b * self.rmax, heads, -1).index_select(0, self.blk_rows)


class BlockContext:
    """The AttentionContext a DFlash layer sees in training: rotary tables of the block rows,
    and per layer the context keys/values it attends to besides its own block."""

    def __init__(self, plan: BlockPlan, cos: torch.Tensor, sin: torch.Tensor,
                 context_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.plan, self.cos, self.sin, self.context_kv = plan, cos, sin, context_kv

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ck, cv = self.context_kv[layer]
        return self.plan.attend(q, k, v, ck, cv)
