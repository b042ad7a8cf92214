"""SDPA over the paged KV cache (CPU and GPU), and cacheless packed causal attention.

Planning turns the layout into gather indices and one boolean mask per step; every layer
then does index_copy (append), one gather of its pages into [B, kv_heads, max_kv, d], and
one SDPA call. Decode-only steps skip the query padding entirely (T == B).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_eval.engine.attention.layout import BatchLayout, page_slots


class TorchAttentionPlan:
    def __init__(self, layout: BatchLayout, device: torch.device) -> None:
        self.layout = layout
        self.num_tokens = layout.num_tokens
        self.positions = layout.position_tensor(device)
        b, q_lens, kv_lens = len(layout.q_lens), layout.q_lens, layout.kv_lens
        self.batch, self.max_q, self.max_kv = b, max(q_lens), max(kv_lens)
        self.cached = layout.block_tables is not None
        # Query rows: packed token t sits at padded row q_rows[t] of a [B * max_q] buffer.
        cu = layout.cu_q()
        self.dense_q = self.max_q == 1 or b == 1
        rows = [bi * self.max_q + i for bi, q in enumerate(q_lens) for i in range(q)]
        self.q_rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.is_causal_only = False
        if self.cached:
            self.slots = layout.slot_mapping(device)
            gather = torch.zeros(b, self.max_kv, dtype=torch.long)
            for bi, (table, kv) in enumerate(zip(layout.block_tables, kv_lens)):
                gather[bi, :kv] = page_slots(table, torch.arange(kv), layout.page_size)
            self.kv_gather = gather.view(-1).to(device)
        else:
            self.kv_gather = None
            # Cacheless keys are the step's own tokens; key j of request b is packed row cu[b]+j.
            gather = torch.zeros(b, self.max_kv, dtype=torch.long)
            for bi, kv in enumerate(kv_lens):
                gather[bi, :kv] = torch.arange(cu[bi], cu[bi] + kv)
            self.self_gather = gather.view(-1).to(device)
            self.is_causal_only = b == 1 and layout.tree_masks is None
        mask = None if self.is_causal_only else self._mask(layout)
        self.mask = None if mask is None else mask.to(device)

    def _mask(self, layout: BatchLayout) -> torch.Tensor | None:
        """[B, 1, max_q, max_kv] bool, True where query row i of request b may see key j."""
        b = self.batch
        if b == 1 and layout.is_decode:
            return None  # one request, one query: every cached key is visible, no padding.
        j = torch.arange(self.max_kv)
        i = torch.arange(self.max_q)
        q_lens = torch.tensor(layout.q_lens)
        kv_lens = torch.tensor(layout.kv_lens)
        ctx = (kv_lens - q_lens).view(b, 1, 1)
        key_ok = j.view(1, 1, -1) < kv_lens.view(b, 1, 1)
        causal = j.view(1, 1, -1) <= ctx + i.view(1, -1, 1)
        mask = key_ok & causal
        if layout.tree_masks is not None:
            for bi, tm in enumerate(layout.tree_masks):
                if tm is None:
                    continue
                q, kv, m = layout.q_lens[bi], layout.kv_lens[bi], tm.shape[1]
                mask[bi, :q, kv - m:kv] = tm.to(device="cpu", dtype=torch.bool)
        # Padded query rows see key 0 only, so SDPA never meets an all-false row (NaN).
        pad_rows = i.view(1, -1) >= q_lens.view(b, 1)
        mask[pad_rows] = j == 0
        return mask.unsqueeze(1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache) -> torch.Tensor:
        t, heads, d = q.shape
        kvh = k.shape[1]
        b, mq, mk = self.batch, self.max_q, self.max_kv
        if self.cached:
            kc, vc = cache.layer(layer)
            # 2-D row views: index ops on [slots, kvh * d] run ~2x faster than on 3-D.
            kc, vc = kc.view(-1, kvh * d), vc.view(-1, kvh * d)
            kc.index_copy_(0, self.slots, k.reshape(t, kvh * d))
            vc.index_copy_(0, self.slots, v.reshape(t, kvh * d))
            keys = kc.index_select(0, self.kv_gather).view(b, mk, kvh, d)
            vals = vc.index_select(0, self.kv_gather).view(b, mk, kvh, d)
        elif self.is_causal_only:
            keys, vals = k.unsqueeze(0), v.unsqueeze(0)
        else:
            keys = k.index_select(0, self.self_gather).view(b, mk, kvh, d)
            vals = v.index_select(0, self.self_gather).view(b, mk, kvh, d)
        if self.dense_q:
            qp = q.view(b, mq, heads, d)
        else:
            qp = q.new_zeros(b * mq, heads, d).index_copy_(0, self.q_rows, q).view(b, mq, heads, d)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
            attn_mask=self.mask, is_causal=self.is_causal_only, enable_gqa=heads != kvh)
        out = out.transpose(1, 2)  # [B, max_q, heads, d]
        if self.dense_q:
            return out.reshape(t, heads, d)
        return out.reshape(b * mq, heads, d).index_select(0, self.q_rows)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def plan(self, layout: BatchLayout) -> TorchAttentionPlan:
        return TorchAttentionPlan(layout, self.device)
