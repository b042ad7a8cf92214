"""Attention for training-time rollout (TTT) over packed sequences.

Step k's query at local position i (rotary position i + k - 1) sees what it would see in the
engine: the step-1 keys of its own sequence at positions <= i (the cache refilled from the
target's hidden states), plus its own earlier draft steps 2..k at position i only. Step 1 is
plain causal attention. No key of another packed sequence is ever visible.

Worked example, one sequence of 3 tokens, step 2, query i = 1: visible keys are step-1 keys
0 and 1 and the step-2 key at 1; not step-1 key 2, not the step-2 keys at 0 or 2.

A step may run at a subset of the positions (COD, heads/cod.py: `select(rows)`, each step's
rows a subset of the step before's). Its queries, keys and values then hold those rows only;
the keys are kept at their positions (zeros elsewhere), which no query sees: a query at
position i reads earlier steps' keys at i only, and i ran at every earlier step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class RolloutPlan:
    """Padding indices for packed sequences [T] <-> padded [B, Tmax], built once per batch."""

    def __init__(self, seq_lens: list[int], device: torch.device | str = "cpu") -> None:
        self.seq_lens = seq_lens
        b, tmax = len(seq_lens), max(seq_lens)
        self.batch, self.tmax = b, tmax
        rows, local = [], []
        for s, n in enumerate(seq_lens):
            rows.extend(s * tmax + i for i in range(n))
            local.extend(range(n))
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)  # packed -> padded row
        self.local = torch.tensor(local, dtype=torch.long, device=device)  # [T] index in its seq
        lens = torch.tensor(seq_lens, device=device)
        i = torch.arange(tmax, device=device)
        key_ok = i.view(1, 1, -1) < lens.view(b, 1, 1)
        self.causal = (i.view(1, -1, 1) >= i.view(1, 1, -1)) & key_ok  # [B, Tmax, Tmax]
        # Padded query rows would see nothing: let them see key 0 (their output is dropped).
        self.causal[:, :, 0] = True
        self.diag = torch.eye(tmax, dtype=torch.bool, device=device).expand(b, -1, -1)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, Tmax, ...] (zeros in padding)."""
        out = x.new_zeros((self.batch * self.tmax, *x.shape[1:]))
        out = out.index_copy(0, self.rows, x)
        return out.view(self.batch, self.tmax, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Tmax, ...] -> [T, ...]."""
        return x.reshape(self.batch * self.tmax, *x.shape[2:]).index_select(0, self.rows)


class RolloutContext:
    """The AttentionContext a head layer sees during rollout step `step` (1-based).

    `keys` accumulates each layer's (k, v) per step across calls, so one context object
    serves a whole K-step rollout of a head of any number of layers: call `next_step()`
    between steps.
    """

    def __init__(self, plan: RolloutPlan, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> None:
        self.plan, self._cos_table, self._sin_table = plan, rope_cos, rope_sin
        self.step = 1
        self.rows: torch.Tensor | None = None  # this step's positions (None: all T)
        self.keys: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> steps
        self._set_rope()

    def _set_rope(self) -> None:
        local = self.plan.local if self.rows is None else self.plan.local[self.rows]
        pos = (local + self.step - 1).clamp(max=self._cos_table.shape[0] - 1)
        self.cos, self.sin = self._cos_table[pos], self._sin_table[pos]

    def select(self, rows: torch.Tensor | None) -> None:
        """This step runs at positions `rows` [n] only (a subset of the step before's)."""
        self.rows = rows
        self._set_rope()

    def next_step(self) -> None:
        self.step += 1
        self._set_rope()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [n, heads, d], k/v [n, kv_heads, d] -> [n, heads, d] (n: the step's rows, T or
        the selected subset)."""
        return self._attend(layer, q, k, v, None)

    def attend_latent(self, layer: int, q: torch.Tensor, latent: torch.Tensor, v_dim: int,
                      scale: float) -> torch.Tensor:
        """MLA (model/mla.py) as multi-query attention: q [T, heads, D], latent [T, 1, D]
        (this step's rows [c_kv ; k_pe]) -> [T, heads, v_dim]; the values are the rows' first
        v_dim columns, as in the engine's latent cache (attention/mla_torch.py)."""
        return self._attend(layer, q, latent, latent[..., :v_dim], scale)

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float | None) -> torch.Tensor:
        p, rows = self.plan, self.rows
        if rows is not None:  # to full [T] rows: keys in place, zeros where the step did not run
            full = (p.rows.numel(), *q.shape[1:])
            q = q.new_zeros(full).index_copy(0, rows, q)
            k = k.new_zeros((full[0], *k.shape[1:])).index_copy(0, rows, k)
            v = v.new_zeros((full[0], *v.shape[1:])).index_copy(0, rows, v)
        keys = self.keys.setdefault(layer, [])
        keys.append((k, v))
        heads, kvh = q.shape[1], k.shape[1]
        qp = p.pad(q).transpose(1, 2)  # [B, heads, Tmax, d]
        ks = [p.pad(kk).transpose(1, 2) for kk, _ in keys]
        vs = [p.pad(vv).transpose(1, 2) for _, vv in keys]
        masks = [p.causal] + [p.diag] * (len(keys) - 1)
        out = F.scaled_dot_product_attention(
            qp, torch.cat(ks, dim=2), torch.cat(vs, dim=2),
            attn_mask=torch.cat(masks, dim=2).unsqueeze(1), scale=scale,
            enable_gqa=heads != kvh)
        out = p.unpad(out.transpose(1, 2))
        return out if rows is None else out.index_select(0, rows)
