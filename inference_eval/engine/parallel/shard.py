"""Which rows or columns of every weight a tensor-parallel rank holds.

Megatron's split (and vLLM's KV rule) over T ranks, seen from rank r; nh query heads and nkv
key/value heads of width d, hidden size H, intermediate size I, vocabulary V, Vp = ceil(V/T):

| weight | split | rank r holds |
|---|---|---|
| qkv_proj [(nh + 2 nkv) d, H] (+ bias) | rows | query heads r*nh/T.., their k, v heads |
| o_proj [H, nh d] | columns (then all-reduce) | the columns of its query heads |
| gate_up_proj [2 I, H] | rows | gate rows r*I/T.. and the same up rows |
| down_proj [H, I] | columns (then all-reduce) | the same I/T columns |
| embed_tokens, lm_head [V, H] | rows (vocabulary-parallel) | rows r*Vp.., zero-padded |
| norms (q/k norms too) | replicated | everything |

KV heads: T divides nkv -> nkv/T heads each; nkv divides T -> one head each, replicated on
T/nkv ranks (query head j reads kv head j // (nh/nkv), and rank r's nh/T query heads all
fall in kv head r*nkv // T). Anything else is refused by name.

A spec is the global index (along its dim) of every local row or column, -1 for padding; the
loader reads those slices (loading.py) and the fingerprint samples them (fingerprint.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_eval.engine.model.arch import ModelArch


@dataclass(frozen=True)
class ShardSpec:
    """dim: 0 (rows), 1 (columns) or None (replicated); index [local] global ids, -1 = pad."""

    dim: int | None
    index: torch.Tensor | None = None

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full tensor (padding rows zero)."""
        if self.dim is None:
            return full.clone()
        safe = self.index.clamp(min=0)
        out = full.index_select(self.dim, safe.to(full.device))
        mask_shape = [1] * full.dim()
        mask_shape[self.dim] = -1
        return out * (self.index >= 0).view(mask_shape).to(out.device, out.dtype)


def _rows(starts_stops: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in starts_stops])


class ShardPlan:
    """The split of one ModelArch over `size` ranks, seen from `rank`."""

    def __init__(self, arch: ModelArch, size: int, rank: int) -> None:
        check_arch(arch, size)
        self.arch, self.size, self.rank = arch, size, rank
        h, kv, t = arch.num_heads, arch.num_kv_heads, size
        self.heads = h // t
        self.kv_heads = kv // t if kv % t == 0 else 1
        self.head_start = rank * self.heads
        self.kv_start = rank * self.kv_heads if kv % t == 0 else rank * kv // t
        self.inter = arch.intermediate_size // t
        self.vocab_per_rank = -(-arch.vocab_size // t)
        self.vocab_start = rank * self.vocab_per_rank

    def local_arch(self) -> ModelArch:
        """The arch of one rank's attention and cache (heads, KV heads, intermediate size
        local; vocabulary and hidden size global: logits are gathered before sampling)."""
        d = self.arch.to_dict()
        d.update(num_heads=self.heads, num_kv_heads=self.kv_heads, intermediate_size=self.inter)
        return ModelArch(**d)

    def qkv_rows(self) -> torch.Tensor:
        a, d = self.arch, self.arch.head_dim
        q0, k0, v0 = 0, a.q_size, a.q_size + a.kv_size
        return _rows([(q0 + self.head_start * d, q0 + (self.head_start + self.heads) * d),
                      (k0 + self.kv_start * d, k0 + (self.kv_start + self.kv_heads) * d),
                      (v0 + self.kv_start * d, v0 + (self.kv_start + self.kv_heads) * d)])

    def vocab_rows(self) -> torch.Tensor:
        idx = torch.arange(self.vocab_start, self.vocab_start + self.vocab_per_rank)
        return torch.where(idx < self.arch.vocab_size, idx, torch.full_like(idx, -1))

    def specs(self) -> dict[str, ShardSpec]:
        """Our parameter name (as TransformerLM names it) -> its spec; replicated ones too."""
        a, d, i = self.arch, self.arch.head_dim, self.inter
        o_cols = _rows([(self.head_start * d, (self.head_start + self.heads) * d)])
        inter = _rows([(self.rank * i, (self.rank + 1) * i)])
        gate_up = torch.cat([inter, inter + a.intermediate_size])
        vocab = ShardSpec(0, self.vocab_rows())
        out = {"embed_tokens.weight": vocab, "norm.weight": ShardSpec(None)}
        if not a.tie_word_embeddings:
            out["lm_head.weight"] = vocab
        for n in range(a.num_layers):
            p = f"layers.{n}."
            out[p + "self_attn.qkv_proj.weight"] = ShardSpec(0, self.qkv_rows())
            if a.qkv_bias:
                out[p + "self_attn.qkv_proj.bias"] = ShardSpec(0, self.qkv_rows())
            out[p + "self_attn.o_proj.weight"] = ShardSpec(1, o_cols)
            if a.qk_norm:
                out[p + "self_attn.q_norm.weight"] = ShardSpec(None)
                out[p + "self_attn.k_norm.weight"] = ShardSpec(None)
            out[p + "mlp.gate_up_proj.weight"] = ShardSpec(0, gate_up)
            out[p + "mlp.down_proj.weight"] = ShardSpec(1, inter)
            out[p + "input_layernorm.weight"] = ShardSpec(None)
            out[p + "post_attention_layernorm.weight"] = ShardSpec(None)
        return out


def check_arch(arch: ModelArch, size: int) -> None:
    """One line naming the key and the numbers when `size` ranks cannot split `arch`."""
    key = f"engine.tensor_parallel={size}"
    if size < 1:
        raise ValueError(f"{key} must be >= 1")
    if arch.is_mla or arch.n_routed_experts:
        raise ValueError(f"{key}: DeepSeek targets (latent attention, experts) are not "
                         "tensor-parallel yet; use engine.tensor_parallel=1")
    if arch.num_heads % size:
        raise ValueError(f"{key} does not divide the target's num_heads={arch.num_heads}; use "
                         f"a divisor of {arch.num_heads}")
    kv = arch.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"{key} and the target's num_kv_heads={kv}: one must divide the "
                         "other (KV heads are split when it divides them, replicated when "
                         "they divide it)")
    if arch.intermediate_size % size:
        raise ValueError(f"{key} does not divide the target's intermediate_size="
                         f"{arch.intermediate_size}")
